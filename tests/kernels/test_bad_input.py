"""Bad input to the public NSA functions: a ValueError naming the argument, before any compute."""

from __future__ import annotations

import pytest
import torch

from nsa_eval import kernels
from nsa_eval.kernels import _validate

B, T, Hq, Hkv, Dk, Dv = 2, 40, 4, 2, 8, 6
PARAMS = dict(block_len=8, stride=4, select_size=16, num_selected=4, num_init=1, num_local=2, window=16)
TC = (T - 8) // 4 + 1


def nsa_inputs(**changes):
    x = dict(q=torch.randn(B, T, Hq, Dk), k=torch.randn(B, T, Hkv, Dk), v=torch.randn(B, T, Hkv, Dv),
             k_cmp=torch.randn(B, TC, Hkv, Dk), v_cmp=torch.randn(B, TC, Hkv, Dv),
             g_cmp=torch.rand(B, T, Hq), g_slc=torch.rand(B, T, Hq), g_swa=torch.rand(B, T, Hq))
    kwargs = dict(PARAMS)
    for name, value in changes.items():
        (x if name in x else kwargs)[name] = value
    return x, kwargs


def call_nsa(**changes):
    x, kwargs = nsa_inputs(**changes)
    return kernels.nsa_attention(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("k_cmp"), x.pop("v_cmp"),
                                 x.pop("g_cmp"), x.pop("g_slc"), x.pop("g_swa"), **kwargs)


def call_decode(**changes):
    x, kwargs = nsa_inputs(**changes)
    q = changes.get("q", x["q"][:, :1])
    gates = [changes.get(n, x[n][:, :1]) for n in ("g_cmp", "g_slc", "g_swa")]
    return kernels.nsa_decode(q, x["k"], x["v"], x["k_cmp"], x["v_cmp"], *gates, **kwargs)


NSA_CASES = {
    "q not a tensor": ("q", dict(q=[[1.0]])),
    "q rank 3": ("q", dict(q=torch.randn(B, T, Hq * Dk))),
    "q int dtype": ("q", dict(q=torch.ones(B, T, Hq, Dk, dtype=torch.int64))),
    "q float64": ("q", dict(q=torch.randn(B, T, Hq, Dk, dtype=torch.float64))),
    "T = 0": ("q", dict(q=torch.randn(B, 0, Hq, Dk))),
    "k dtype differs": ("k", dict(k=torch.randn(B, T, Hkv, Dk).half())),
    "k on another device": ("k", dict(k=torch.empty(B, T, Hkv, Dk, device="meta"))),
    "k batch differs": ("k", dict(k=torch.randn(B + 1, T, Hkv, Dk))),
    "k length differs": ("k", dict(k=torch.randn(B, T - 1, Hkv, Dk))),
    "k head dim differs": ("k", dict(k=torch.randn(B, T, Hkv, Dk + 1))),
    "heads do not divide": ("k", dict(k=torch.randn(B, T, 3, Dk), v=torch.randn(B, T, 3, Dv))),
    "v heads differ from k": ("v", dict(v=torch.randn(B, T, 1, Dv))),
    "too few compressed blocks": ("k_cmp", dict(k_cmp=torch.randn(B, TC - 1, Hkv, Dk),
                                                v_cmp=torch.randn(B, TC - 1, Hkv, Dv))),
    "k_cmp heads differ from k": ("k_cmp", dict(k_cmp=torch.randn(B, TC, 1, Dk),
                                                v_cmp=torch.randn(B, TC, 1, Dv))),
    "v_cmp dim differs from v": ("v_cmp", dict(v_cmp=torch.randn(B, TC, Hkv, Dv + 2))),
    "v_cmp length differs": ("v_cmp", dict(v_cmp=torch.randn(B, TC + 1, Hkv, Dv))),
    "gate shape": ("g_slc", dict(g_slc=torch.rand(B, T, Hkv))),
    "gate dtype": ("g_cmp", dict(g_cmp=torch.rand(B, T, Hq).bfloat16())),
    "k_swa shape": ("k_swa", dict(k_swa=torch.randn(B, T, Hkv, Dk + 1))),
    "v_swa dtype": ("v_swa", dict(v_swa=torch.randn(B, T, Hkv, Dv).half())),
    "stride does not divide block_len": ("stride", dict(block_len=8, stride=3)),
    "select_size not a multiple of stride": ("select_size", dict(select_size=18)),
    "block_len zero": ("block_len", dict(block_len=0)),
    "block_len bool": ("block_len", dict(block_len=True)),
    "stride float": ("stride", dict(stride=4.0)),
    "num_selected below forced blocks": ("num_selected", dict(num_selected=2)),
    "num_local negative": ("num_local", dict(num_local=-1)),
    "window zero": ("window", dict(window=0)),
    "scale negative": ("scale", dict(scale=-0.1)),
    "scale nan": ("scale", dict(scale=float("nan"))),
    "impl unknown": ("impl", dict(impl="cuda")),
    "gate_in_branches not a bool": ("gate_in_branches", dict(gate_in_branches="yes")),
}


@pytest.mark.parametrize("case", list(NSA_CASES), ids=list(NSA_CASES))
def test_nsa_attention_rejects(case):
    name, changes = NSA_CASES[case]
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        call_nsa(**changes)
    assert "expected" in str(info.value) or "must" in str(info.value)


def test_messages_give_the_expected_shape():
    with pytest.raises(ValueError) as info:
        call_nsa(v_cmp=torch.randn(B, TC, Hkv, Dv + 2))
    assert str(info.value) == (f"v_cmp: expected shape [B, Tc, Hkv, Dv] = [{B}, {TC}, {Hkv}, {Dv}], "
                               f"got [{B}, {TC}, {Hkv}, {Dv + 2}]")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for fn in (call_nsa, call_decode):
        with pytest.raises(ValueError, match=r"^impl: .*TRITON_INTERPRET=1"):
            fn(impl="triton")
    x, _ = nsa_inputs()
    with pytest.raises(ValueError, match="^impl: "):
        kernels.sliding_window_attention(x["q"], x["k"], x["v"], impl="triton")


def test_triton_head_dims_are_limited(monkeypatch):
    """Head dims past the Triton kernels' (256; 128 in float32) are a ValueError naming the dim, before
    any kernel compiles; the reference takes them."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    wide = dict(q=torch.randn(B, T, Hq, 160), k=torch.randn(B, T, Hkv, 160),
                k_cmp=torch.randn(B, TC, Hkv, 160))
    with pytest.raises(ValueError, match=r"^q: .* up to 128 in float32, got Dk = 160; .*bfloat16"):
        call_nsa(impl="triton", **wide)
    x, _ = nsa_inputs(**wide)
    with pytest.raises(ValueError, match="Dk = 160"):
        kernels.select_blocks(x["q"], x["k_cmp"], block_len=8, stride=4, select_size=16, impl="triton")
    assert call_nsa(impl="reference", **wide).shape == (B, T, Hq, Dv)
    v = torch.randn(B, T, Hkv, 512).bfloat16()
    q, k = torch.randn(B, T, Hq, 64).bfloat16(), torch.randn(B, T, Hkv, 64).bfloat16()
    with pytest.raises(ValueError, match=r"^q: .* 256 in bfloat16, got Dv = 512; use impl='reference'$"):
        kernels.sliding_window_attention(q, k, v, window=16, impl="triton")
    with pytest.raises(ValueError, match="Dv = 512"):
        call_decode(impl="triton", v=torch.randn(B, T, Hkv, 512), v_cmp=torch.randn(B, TC, Hkv, 512))


def test_gate_in_branches_changes_nothing_for_the_reference():
    """`gate_in_branches` is a choice of the Triton backward: the reference takes it and computes the
    same output."""
    x, kwargs = nsa_inputs()
    args = [x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp", "g_cmp", "g_slc", "g_swa")]
    o = kernels.nsa_attention(*args, **kwargs, impl="reference")
    assert torch.equal(kernels.nsa_attention(*args, **kwargs, gate_in_branches=True, impl="reference"), o)


def test_branch_functions_reject():
    x, _ = nsa_inputs()
    q, k, v, k_cmp, v_cmp = x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"]
    with pytest.raises(ValueError, match="^v_cmp: "):
        kernels.compressed_attention(q, k_cmp, v_cmp[:, 1:], block_len=8, stride=4)
    with pytest.raises(ValueError, match="^k_cmp: "):
        kernels.compressed_attention(q, k_cmp[:, :0], v_cmp[:, :0])  # l=32, d=16: T=40 holds 1 block
    with pytest.raises(ValueError, match="^k_cmp: "):
        kernels.select_blocks(q, torch.randn(B, TC, 3, Dk), block_len=8, stride=4, select_size=16)
    with pytest.raises(ValueError, match="^num_selected: "):
        kernels.select_blocks(q, k_cmp, block_len=8, stride=4, select_size=16, num_selected=0, num_init=0,
                              num_local=0)
    good = torch.zeros(B, T, Hkv, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="^block_indices: "):
        kernels.selected_attention(q, k, v, good.float(), select_size=16)
    with pytest.raises(ValueError, match="^block_indices: "):
        kernels.selected_attention(q, k, v, good[:, :, :1], select_size=16)
    with pytest.raises(ValueError, match="^block_indices: "):
        kernels.selected_attention(q, k, v, good[..., :0], select_size=16)
    with pytest.raises(ValueError, match="^select_size: "):
        kernels.selected_attention(q, k, v, good, select_size=0)
    with pytest.raises(ValueError, match="^window: "):
        kernels.sliding_window_attention(q, k, v, window=-3)


DECODE_CASES = {
    "q with two new tokens": ("q", dict(q=torch.randn(B, 2, Hq, Dk))),
    "gate over T": ("g_swa", dict(g_swa=torch.rand(B, T, Hq))),
    "cache_seqlens zero": ("cache_seqlens", dict(cache_seqlens=torch.tensor([0, 5], dtype=torch.int32))),
    "cache_seqlens past the cache": ("cache_seqlens", dict(cache_seqlens=torch.tensor([T + 1, 5]).int())),
    "cache_seqlens shape": ("cache_seqlens", dict(cache_seqlens=torch.tensor([5], dtype=torch.int32))),
    "cache_seqlens float": ("cache_seqlens", dict(cache_seqlens=torch.tensor([5.0, 6.0]))),
    "compressed cache too short": ("k_cmp", dict(k_cmp=torch.randn(B, 2, Hkv, Dk),
                                                 v_cmp=torch.randn(B, 2, Hkv, Dv))),
    "empty cache": ("k", dict(k=torch.randn(B, 0, Hkv, Dk), v=torch.randn(B, 0, Hkv, Dv))),
    "window ring shorter than the window": ("k_swa", dict(k_swa=torch.randn(B, 15, Hkv, Dk),
                                                          v_swa=torch.randn(B, 15, Hkv, Dv))),
    "window ring without its values": ("v_swa", dict(k_swa=torch.randn(B, 16, Hkv, Dk))),
    "window values of another ring": ("v_swa", dict(k_swa=torch.randn(B, 16, Hkv, Dk),
                                                    v_swa=torch.randn(B, 20, Hkv, Dv))),
}


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_nsa_decode_rejects(case):
    name, changes = DECODE_CASES[case]
    with pytest.raises(ValueError, match=rf"^{name}: "):
        call_decode(**changes)


def test_short_compressed_cache_is_fine_for_short_sequences():
    """cache_seqlens decides how many compressed blocks are needed, not the cache size S."""
    o = call_decode(k_cmp=torch.randn(B, 2, Hkv, Dk), v_cmp=torch.randn(B, 2, Hkv, Dv),
                    cache_seqlens=torch.tensor([12, 9], dtype=torch.int32))  # 12 tokens hold 2 blocks
    assert o.shape == (B, 1, Hq, Dv) and torch.isfinite(o).all()


@pytest.mark.parametrize("version", ["3.5.1", "3.9.0", "4.0.0+git1234"])
def test_triton_outside_the_tested_range_is_refused_with_the_fix(version):
    with pytest.raises(ImportError, match=r"Triton 3\.6 to 3\.8, found .*pip install 'triton>=3\.6,<3\.9'"):
        _validate.check_triton_version(version)


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.8.0"])
def test_triton_in_the_tested_range_passes(version):
    _validate.check_triton_version(version)

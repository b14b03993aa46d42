"""The fused decode step's Triton kernels against their PyTorch references, on the CPU through Triton's
interpreter: `decode_inputs` (a decode token's RoPE, gates and cache writes from its one projection),
`add_rms_norm` (the residual add with the norm after it) and the compression's `block_inputs` and
`write_block`, over the model's config variants.

RoPE and the cache writes match bit for bit in float32 and bfloat16 (each product rounded as torch
rounds it); a gate may differ by one float32 ulp of its sigmoid, and a norm by the order of its sum."""

import os

import pytest
import torch

from nsa_eval.kernels.decode_compress import (
    block_inputs,
    block_inputs_reference,
    write_block,
    write_block_reference,
)
from nsa_eval.kernels.decode_inputs import decode_inputs, decode_inputs_reference
from nsa_eval.kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from nsa_eval.models.modeling_nsa import rope_cos_sin
from tests.kernels.sm90 import json_from_fresh_python
from tests.kernels.test_triton_kernels import rel_err

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                      reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

# (shared_kv, own window ring, compression "mean" (rotated compression inputs), window gate)
VARIANTS = {
    "paper": (False, True, False, True),
    "fla": (True, False, True, True),
    "fla_no_window": (True, False, True, False),
    "no_window": (False, False, False, False),
    "mean_separate": (False, True, True, True),
}


def _case(variant, dtype, B=3, Hq=6, Hkv=2, Dk=24, Dv=16, S=20, l=8, W=6, pos=13, seed=0):
    shared, swa, mean, gate_swa = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    n = Hq * Dk + Hkv * (Dk + Dv) * (1 if shared else 3 if swa else 2)
    y = rnd(B, n + 3 * Hq + 5)[:, :-5]  # the gate logits last, rows with a stride past their width
    cos, sin = rope_cos_sin(torch.tensor([pos]), Dk, 10000.0, dtype)
    caches = dict(k=rnd(B, S, Hkv, Dk), v=rnd(B, S, Hkv, Dv), k_cmp_in=rnd(B, l, Hkv, Dk),
                  v_cmp_in=rnd(B, l, Hkv, Dv))
    if swa:
        caches |= dict(k_swa=rnd(B, W, Hkv, Dk), v_swa=rnd(B, W, Hkv, Dv))
    rows = dict(pos=torch.tensor([pos]), cmp_in_row=torch.tensor([pos % l]),
                window_row=torch.tensor([pos % W]) if swa else None)
    flags = dict(shared_kv=shared, rope_cmp_in=mean, gate_swa=gate_swa)
    return y, y[:, n:], cos, sin, caches, rows, flags


def _run(fn, y, g, cos, sin, caches, rows, flags):
    caches = {name: x.clone() for name, x in caches.items()}
    out = fn(y, g, cos, sin, caches["k"], caches["v"], caches["k_cmp_in"], caches["v_cmp_in"], rows["pos"],
             rows["cmp_in_row"], k_swa=caches.get("k_swa"), v_swa=caches.get("v_swa"),
             window_row=rows["window_row"], **flags)
    return out, caches


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@interpreter_only
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_inputs_equals_reference(variant, dtype):
    case = _case(variant, dtype)
    (q, *gates), caches = _run(decode_inputs, *case)
    (q_ref, *gates_ref), caches_ref = _run(decode_inputs_reference, *case)
    assert q.shape == (3, 1, 6, 24) and q.is_contiguous() and torch.equal(q, q_ref)
    for x, x_ref in zip(gates, gates_ref, strict=True):
        assert x.shape == (3, 1, 6) and x.is_contiguous()
        torch.testing.assert_close(x, x_ref, atol=0, rtol=2e-7 if dtype == torch.float32 else 0.008)
    if not case[-1]["gate_swa"]:
        assert not gates[2].any()
    for name in caches:  # the token's rows written, every other row as it was
        assert torch.equal(caches[name], caches_ref[name]), name
        assert (caches[name] != case[4][name]).any(dim=(0, 2, 3)).sum() == 1, name


@interpreter_only
def test_decode_inputs_refuses_a_short_projection():
    y, g, cos, sin, caches, rows, flags = _case("paper", torch.float32)
    with pytest.raises(ValueError, match="y must be"):
        _run(decode_inputs, y[:, :40], g, cos, sin, caches, rows, flags)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@interpreter_only
@pytest.mark.parametrize("C", [64, 96, 2048])
@interpreter_only
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "norm_only"])
def test_add_rms_norm_equals_reference(C, dtype, with_residual):
    g = torch.Generator().manual_seed(C)
    x, r = (3 * torch.randn(2, 1, C, generator=g)).to(dtype), torch.randn(2, 1, C, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(C, generator=g)).to(dtype)
    residual = r if with_residual else None
    (h, y), (h_ref, y_ref) = add_rms_norm(x, residual, w, 1e-6), add_rms_norm_reference(x, residual, w, 1e-6)
    assert torch.equal(h, h_ref) and y.dtype == y_ref.dtype
    if residual is None:
        assert h is x
    if dtype == torch.float32:  # the sum of squares in another order: ulps of float32
        assert rel_err(y, y_ref) < 1e-6
    else:  # each element rounded as torch rounds it; a sum in another order may flip one by an ulp
        torch.testing.assert_close(y, y_ref, atol=0, rtol=0.008)
        assert (y != y_ref).float().mean() < 0.01


@interpreter_only
def test_add_rms_norm_keeps_a_float32_weight():
    """A float32 scale over a bf16 stream gives float32, as torch's promotion does."""
    x = torch.randn(2, 1, 32).to(torch.bfloat16)
    w = torch.rand(32)
    h, y = add_rms_norm(x, x, w, 1e-5)
    assert y.dtype == torch.float32
    assert rel_err(y, add_rms_norm_reference(x, x, w, 1e-5)[1]) < 1e-6



@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["mlp", "mean"])
@pytest.mark.parametrize("L", [8, 6])  # 6: a block length the tile pads to 8
def test_block_inputs_equals_reference(mode, dtype, L):
    g = torch.Generator().manual_seed(1)
    B, Hkv, Dk, Dv = 2, 3, 12, 20

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_ring, v_ring = rnd(B, L, Hkv, Dk), rnd(B, L, Hkv, Dv)
    rows = (torch.arange(L) + 5) % L  # a block that wraps around the ring
    pos_emb = () if mode == "mean" else (rnd(L, Dk), rnd(L, Dv))
    for tri, ref in zip(block_inputs(k_ring, v_ring, rows, *pos_emb),
                        block_inputs_reference(k_ring, v_ring, rows, *pos_emb), strict=True):
        assert tri.shape == ref.shape and tri.dtype == ref.dtype
        if mode == "mlp":
            assert torch.equal(tri, ref)
        else:  # a float32 sum in another order
            torch.testing.assert_close(tri, ref, atol=1e-6, rtol=0.008 if dtype == torch.bfloat16 else 1e-6)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm,rope", [(False, True), (True, True), (False, False), (True, False)],
                         ids=["mlp", "mlp_norm", "mean", "mean_norm"])
def test_write_block_equals_reference(norm, rope, dtype):
    g = torch.Generator().manual_seed(2)
    B, Sc, Hkv, Dk, Dv = 2, 7, 3, 16, 24

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_blk, v_blk = 4 * rnd(B, 1, Hkv, Dk), rnd(B, 1, Hkv, Dv)
    caches = rnd(B, Sc, Hkv, Dk), rnd(B, Sc, Hkv, Dv)
    cos, sin = rope_cos_sin(torch.tensor([48]), Dk, 10000.0, dtype) if rope else (None, None)
    kwargs = dict(norm_weight=(1 + 0.1 * torch.randn(Dk, generator=g)).to(dtype) if norm else None, eps=1e-6,
                  cos=cos, sin=sin)
    tri, ref = [x.clone() for x in caches], [x.clone() for x in caches]
    write_block(k_blk, v_blk, *tri, torch.tensor([4]), **kwargs)
    write_block_reference(k_blk, v_blk, *ref, torch.tensor([4]), **kwargs)
    for a, b, before in zip(tri, ref, caches, strict=True):
        if norm and dtype == torch.float32:  # the norm's sum in another order: ulps
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(a, b)
        assert (a != before).any(dim=(0, 2, 3)).nonzero().flatten().tolist() == [4]  # that row only


COMPILE = """
import json
from tests.kernels.sm90 import compile_sm90
from nsa_eval.kernels.decode_compress import (
    block_inputs,
    block_inputs_reference,
    write_block,
    write_block_reference,
)
from nsa_eval.kernels.decode_compress import _block_inputs_kernel, _write_block_kernel
from nsa_eval.kernels.decode_inputs import _decode_inputs_kernel
from nsa_eval.kernels.rms_norm import _add_rms_norm_kernel
ptx = {}
for dt in ("bf16", "fp32"):
    for shared, swa, mean, gate in ((False, True, False, True), (True, False, True, False)):
        consts = dict(HQ=32, HKV=8, DK=64, DV=64, BDK=64, BDV=64, SHARED_KV=shared, HAS_SWA=swa,
                      ROPE_CMP=mean, GATE_SWA=gate)
        types = [f"*{dt}"] * 12 + ["*i64"] * 3 + ["i32"] * 15
        kernel = compile_sm90(_decode_inputs_kernel, types, consts, dict(num_warps=1, enable_fp_fusion=False))
        ptx[f"decode_inputs {dt} shared_kv={shared}"] = kernel.asm["ptx"]
    kernel = compile_sm90(_add_rms_norm_kernel, [f"*{dt}"] * 5 + ["fp32"], dict(C=2048, BC=2048, HAS_R=True),
                          dict(num_warps=8, enable_fp_fusion=False))
    ptx[f"add_rms_norm {dt}"] = kernel.asm["ptx"]
    for mean in (False, True):
        kernel = compile_sm90(_block_inputs_kernel, [f"*{dt}"] * 6 + ["*i64"] + ["i32"] * 6,
                              dict(L=32, BL=32, DK=64, DV=64, BDK=64, BDV=64, MEAN=mean), dict(num_warps=2))
        ptx[f"block_inputs {dt} mean={mean}"] = ""
    types = [f"*{dt}"] * 4 + ["*i64"] + [f"*{dt}"] * 3 + ["i32"] * 6 + ["fp32"]
    consts = dict(HKV=8, DK=64, DV=64, BDK=64, BDV=64, NORM=True, ROPE=True)
    kernel = compile_sm90(_write_block_kernel, types, consts, dict(num_warps=1, enable_fp_fusion=False))
    ptx[f"write_block {dt}"] = kernel.asm["ptx"]
print(json.dumps({name: "fma.rn.f32" in text for name, text in ptx.items()}))
"""


def test_fused_decode_kernels_compile_for_h200():
    """The kernels compile for sm_90 at the 1B model's shape (32 / 8 heads of 64, hidden 2048), in bf16 and
    float32, without fused multiply-adds (torch rounds each product before the sum)."""
    fma = json_from_fresh_python(COMPILE)
    assert len(fma) == 12 and not any(fma.values()), fma

"""TMA copies (`band.BAND_TMA`; the selected forward wherever `tma_ok`): the banded kernels and the
selected forward read their tiles through tensor descriptors (Hopper's tensor memory accelerator)
by default; with it off, through per-thread loads. On the CPU (Triton's interpreter) both paths must
give the same values up to float32 rounding, and the reference's; inputs TMA cannot address fall
back to the loads; `tma_ok` says which. On a GPU (`-m gpu`) the two paths are compared at 8k in bf16."""

from __future__ import annotations

import os

import pytest
import torch

from nsa_eval.kernels import _triton_utils, band, selection
from nsa_eval.kernels import reference as ref
from tests.kernels.sm90 import json_from_fresh_python
from tests.kernels.test_triton_kernels import TOL, make, rel_err

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                      reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def branches(x, block_indices, *, tma, window=40, select_size=32):
    """Each branch's kernels called as its autograd op calls them, with TMA copies in every kernel
    that takes them (`tma=True`, where `tma_ok`) or in none (False): the outputs (o and lse of the
    compression, the window's o, the selected o) and, for random output gradients, dq (of the three
    branches), dk and dv (of the window's and the selected branch's keys), dk_cmp and dv_cmp."""
    q, k, v, k_cmp, v_cmp = (x[n].detach() for n in ("q", "k", "v", "k_cmp", "v_cmp"))
    scale = q.shape[-1] ** -0.5
    cmp = dict(scale=scale, key_stride=16, key_offset=31, tma=tma)
    swa = dict(scale=scale, key_stride=1, key_offset=0, window=window, tma=tma)
    o_cmp, lse = band.band_forward(q, k_cmp, v_cmp, **cmp)
    o_swa, lse_swa = band.band_forward(q, k, v, **swa)
    o_slc, lse_slc = selection.selected_forward(q, k, v, block_indices, select_size=select_size, scale=scale,
                                                tma=tma, per_block=False)  # the walk: per block ignores tma
    g = torch.Generator(device=q.device).manual_seed(1)
    rnd = lambda t: torch.randn(t.shape, generator=g, device=q.device).to(t.dtype)  # noqa: E731
    finite = torch.isfinite(lse)
    do_cmp, dlse, do_swa, do_slc = rnd(o_cmp), torch.where(finite, rnd(lse), 0.0), rnd(o_swa), rnd(o_slc)
    dq_cmp, dk_cmp, dv_cmp = band.band_backward(q, k_cmp, v_cmp, o_cmp, lse, do_cmp, dlse, **cmp,
                                                split_heads=True)
    dq_swa, dk_swa, dv_swa = band.band_backward(q, k, v, o_swa, lse_swa, do_swa, **swa)
    dq_slc, dk_slc, dv_slc = selection.selected_backward(q, k, v, block_indices, o_slc, lse_slc, do_slc,
                                                         select_size=select_size, scale=scale)
    dq = dq_cmp.float() + dq_swa.float() + dq_slc.float()
    return [o_cmp, torch.where(finite, lse, 0.0), o_swa, o_slc, dq, dk_swa.float() + dk_slc.float(),
            dv_swa.float() + dv_slc.float(), dk_cmp, dv_cmp]


def random_blocks(B, T, hkv, n, select_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-T // select_size)
    rows = [torch.randperm(nb, generator=g)[:n] for _ in range(B * T * hkv)]
    return torch.stack(rows).view(B, T, hkv, -1).sort(-1).values.int()


@interpreter_only
@pytest.mark.parametrize("shape", [(1, 83, 16, 1, 16, 16), (2, 77, 8, 2, 16, 32), (1, 97, 2, 2, 32, 32)],
                         ids=["G16", "G4", "G1"])
def test_tma_matches_loads(shape):
    """Every branch forward and backward, T not a multiple of any tile (TMA's zero rows past T): the
    same values up to float32 rounding, and the selected output the reference's. (Not the same bits:
    the interpreter's products are numpy's, whose BLAS may sum in another order for a tile of another
    memory layout; with numpy 2.4.6 the banded kernels at G = 1, d = 32 differ by up to 2e-6.)"""
    x = make(*shape)
    bi = random_blocks(shape[0], shape[1], shape[3], 3, 32)
    with_tma = branches(x, bi, tma=True)
    for a, b in zip(with_tma, branches(x, bi, tma=False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    o_ref = ref.selected_attention(x["q"], x["k"], x["v"], bi.long(), select_size=32)
    assert rel_err(with_tma[3], o_ref) < TOL


def test_tma_ok_names_what_tma_can_copy():
    """Unit-stride head dims, 16-byte aligned bases and strides, on a GPU of compute capability 9.0 or
    later or in the interpreter; never CPU tensors outside it (checked in a fresh Python)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter, on a CPU
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0 or later")
    x = torch.zeros(2, 64, 4, 32, device=device)
    assert _triton_utils.tma_ok(x, x[:, :, :2])  # a slice of heads: strides unchanged
    assert not _triton_utils.tma_ok(x[..., ::2])  # head dim not unit-stride
    offset = torch.zeros(2 * 64 * 4 * 32 + 1, device=device)[1:].view(2, 64, 4, 32)
    assert not _triton_utils.tma_ok(offset)  # a 4-byte offset
    assert not _triton_utils.tma_ok(torch.zeros(2, 64, 4, 3, device=device))  # a row of 12 bytes
    code = ("import json, torch\nfrom nsa_eval.kernels._triton_utils import tma_ok\n"
            "print(json.dumps(tma_ok(torch.zeros(2, 64, 4, 32))))")
    assert json_from_fresh_python(code, timeout=300) is False


@interpreter_only
def test_unaligned_inputs_fall_back_to_loads():
    """Keys and values at a 4-byte offset (a view into a larger buffer) cannot be TMA-copied: asked
    for TMA, the kernels read them through the loads and still match the reference."""
    B, T, hq, hkv, d = 1, 90, 4, 1, 16
    x = make(B, T, hq, hkv, d, d)
    q = x["q"].detach()
    buf = torch.randn(2 * B * T * hkv * d + 1)
    k = buf[1:1 + B * T * hkv * d].view(B, T, hkv, d)
    v = buf[1 + B * T * hkv * d:].view(B, T, hkv, d)
    assert not _triton_utils.tma_ok(k, v)
    bi = random_blocks(B, T, hkv, 2, 16)
    o, _ = band.band_forward(q, k, v, scale=d ** -0.5, key_stride=1, key_offset=0, window=24, tma=True)
    assert rel_err(o, ref.sliding_window_attention(q, k, v, window=24)) < TOL
    o, _ = selection.selected_forward(q, k, v, bi, select_size=16, scale=d ** -0.5, tma=True)
    assert rel_err(o, ref.selected_attention(q, k, v, bi.long(), select_size=16)) < TOL


@pytest.mark.gpu
def test_gpu_tma_matches_loads():
    """bf16 at 8k, 16/1 heads (G = 16) and 16/4 (G = 4): every branch, forward and backward, TMA on
    against off. Not bit for bit: the compression forward takes its own tiles with TMA
    (`BAND_CONFIGS["cmp"]["fwd_tma"]`) and the selected dk/dv adds float32 atomics in any order; a
    wrong or missing tile would be off by ~1e-1."""
    from nsa_eval.bench.kernels import _inputs
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.importance import select_blocks

    torch.manual_seed(0)
    for hq, hkv in ((16, 1), (16, 4)):
        x = _inputs(1, 8192, hq, hkv, 128, grad=False)
        with torch.no_grad():
            _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
            bi = select_blocks(x["q"], x["k_cmp"], lse=lse)
        with_tma = branches(x, bi, tma=True, window=512, select_size=64)
        loads = branches(x, bi, tma=False, window=512, select_size=64)
        for i, (a, b) in enumerate(zip(with_tma, loads, strict=True)):
            assert rel_err(a, b) < (2e-3 if i < 4 else 1e-2), i


COMPILE = r"""
import json
import torch
from nsa_eval.kernels import band, selection as s
from tests.kernels.sm90 import compile_sm90, pointers_then_scalars

def desc(rows, cols):
    return f"tensordesc<bf16[1,{rows},1,{cols}]>"

out = {}
consts = dict(DK=128, DV=128, BDK=128, BDK2=0, BDV=128, GP=16, BT=1, BS=64, NP=16, UPCAST=False, TMA=True,
              GATE_SUM=False, STORE_O=True, PACKED=False)
fwd = s._selected_fwd_kernel
pointers = ["*bf16", desc(64, 128), desc(64, 128), "*i32", "*bf16", "*fp32"] + ["*bf16"] * 6
out["selected fwd"] = compile_sm90(fwd, pointers_then_scalars(fwd, pointers, consts), consts,
                                   s.selected_fwd_launch(1, 128, True)).asm["ptx"]
cfg = band._band_config(None, "fwd", torch.bfloat16, tma=True)
consts = dict(HAS_WINDOW=False, DK=128, DV=128, BDK=128, BDK2=0, BDV=128, BM=cfg.pop("BM"), BN=cfg.pop("BN"),
              UPCAST=False, SPLIT_MASK=True, TMA=True)
kernel = band._band_fwd_kernel
pointers = ["*bf16", desc(consts["BN"], 128), desc(consts["BN"], 128), "*bf16", "*fp32"]
types = pointers_then_scalars(kernel, pointers, consts)
out["band fwd"] = compile_sm90(kernel, types, consts, cfg).asm["ptx"]
print(json.dumps({k: v.count("cp.async.bulk.tensor") for k, v in out.items()}))
"""


def test_default_launches_copy_with_tma_on_h200():
    """Compiled for sm_90 as the defaults launch them (descriptors for K and V), the selected forward
    and the compression forward copy their tiles with TMA bulk-tensor copies (`cp.async.bulk.tensor`:
    K and V, in each of the forward's loops)."""
    from tests.kernels.sm90 import json_from_fresh_python

    assert band._tma(None, "fwd")
    got = json_from_fresh_python(COMPILE, timeout=600)
    assert got["selected fwd"] >= 2, got
    assert got["band fwd"] >= 4, got  # interior and diagonal loops

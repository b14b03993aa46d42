"""The fused decode step's Triton kernels against their PyTorch references, on the CPU through Triton's
interpreter: `decode_inputs` (a decode token's RoPE, gates and cache writes from its one projection) and
`add_rms_norm` (the residual add with the norm after it), over the model's config variants.

RoPE and the cache writes match bit for bit in float32 and bfloat16 (each product rounded as torch
rounds it); a gate may differ by one float32 ulp of its sigmoid, and a norm by the order of its sum."""

import os

import pytest
import torch

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


COMPILE = """
import json
from tests.kernels.sm90 import compile_sm90
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
print(json.dumps({name: "fma.rn.f32" in text for name, text in ptx.items()}))
"""


def test_fused_decode_kernels_compile_for_h200():
    """Both kernels compile for sm_90 at the 1B model's shape (32 / 8 heads of 64, hidden 2048), in bf16
    and float32, without fused multiply-adds (torch rounds each product before the sum)."""
    fma = json_from_fresh_python(COMPILE)
    assert len(fma) == 6 and not any(fma.values()), fma

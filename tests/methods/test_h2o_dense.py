"""H2O with a dense prompt (nsa_eval/baseline_kernels/h2o_dense.py) against its references and the controller.

The mass pass (`key_mass`) and the forward that returns the log-sum-exp (`attention_lse_triton`) run
under Triton's interpreter here, against `key_mass_reference` and `attention_lse_reference`; through the
controller, `sparse_prefill: false` on the kernels leaves the chunked path's output, mass state and
counts. On a GPU the forward is SDPA's own kernel asked for its lse (`_sdpa_lse`).
"""

import pytest
import torch
import triton
import triton.language as tl

from nsa_eval.baseline_kernels import h2o_dense as hd
from nsa_eval.methods import apply_attention
from nsa_eval.methods.base import BudgetConfig
from nsa_eval.methods.controller import MODULE_ATTRIBUTE, AttentionController
from nsa_eval.methods.h2o import H2O
from tests.methods.budget_inputs import rel_rms
from tests.methods.conftest import fake_module, prefill_by, prefill_then_decode, random_qkv, tiny_llama
from tests.methods.interpreter_bounds import in_bounds

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (B, Hq, Hkv, T, D): G = 1, 2 and 4; T a multiple of the interpreter's 16-row tiles or not
SHAPES = [(2, 4, 2, 50, 16), (1, 4, 1, 64, 32), (1, 2, 2, 33, 16), (1, 8, 2, 17, 64)]
IDS = [f"B{s[0]}-Hq{s[1]}-Hkv{s[2]}-T{s[3]}-D{s[4]}" for s in SHAPES]


def qkv(shape, dtype, seed=0):
    B, Hq, Hkv, T, D = shape
    q, k, v = random_qkv(B, Hq, Hkv, T, D, seed=seed)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_key_mass_matches_reference(shape, dtype):
    """Each key's summed probabilities, from the same lse; every query hands out exactly 1."""
    q, k, v = qkv(shape, dtype, seed=sum(shape))
    scale = shape[-1] ** -0.5
    _, lse = hd.attention_lse_reference(q, k, v, scale)
    with in_bounds():
        mass = hd.key_mass(q, k, lse, scale)
    torch.testing.assert_close(mass, hd.key_mass_reference(q, k, lse, scale), rtol=1e-5, atol=1e-6)
    T = shape[3]
    torch.testing.assert_close(mass.sum(-1), torch.full_like(mass[..., 0], T), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_triton_forward_matches_reference(shape, dtype):
    """The fallback forward's output and natural lse."""
    q, k, v = qkv(shape, dtype, seed=sum(shape) + 1)
    scale = shape[-1] ** -0.5
    out_ref, lse_ref = hd.attention_lse_reference(q, k, v, scale)
    with in_bounds():
        out, lse = hd.attention_lse_triton(q, k, v, scale)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), out_ref, rtol=tol, atol=tol)


@triton.jit
def _one_past_the_end(X, N):
    tl.store(X + tl.arange(0, 16), 1.0, mask=tl.arange(0, 16) <= N)  # writes X[N], one past the end


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's check")
def test_bounds_check_catches_a_stray_store():
    """`in_bounds` fails a kernel that writes one element past its tensor (its own honest check)."""
    x = torch.zeros(8)
    with pytest.raises(Exception, match="outside its tensors"), in_bounds():
        _one_past_the_end[(1,)](x, 8)


def layer_call(q, k, v, budget, sink, local, kernel, sparse_prefill=False, G=None):
    """One H2O layer call through the controller: (out `[B, T, Hq, Dv]`, mass state, statistics)."""
    config = BudgetConfig(budget, sink, local, sparse_prefill=sparse_prefill)
    controller = AttentionController(prefill_by(H2O(query_chunk=16), kernel), config)
    controller.states = {}
    out = controller.attend(fake_module(groups=G or q.shape[1] // k.shape[1]), q, k, v, None, None)
    return out, controller.states[0].tensors["mass"], controller.stats.summary()


@pytest.mark.parametrize(("T", "sparse_prefill"), [(30, False), (100, False), (30, True)],
                         ids=["dense-30", "dense-100", "sparse-30"])
def test_controller_kernels_match_chunked_path(T, sparse_prefill):
    """`sparse_prefill: false` (every query dense), or a prompt within the budget (40): the kernels leave
    the chunked path's output, mass and counts (statistics equal; nothing evicted at prefill). A sparse
    prefill past the budget: test_h2o_fast.py::test_controller_fast_path."""
    q, k, v = random_qkv(B=2, Hq=4, Hkv=2, T=T, D=16, seed=T)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    (out_ref, mass_ref, stats_ref), (out, mass, stats) = (
        layer_call(q, k, v, 40, 4, 12, kernel, sparse_prefill) for kernel in (False, True))
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, mass_ref, rtol=1e-5, atol=1e-6)
    assert (mass > 0).all()  # no key evicted
    assert stats == stats_ref
    assert stats["phases"]["prefill"]["max"] == T


def test_model_dense_prefill_then_decode():
    """A tiny Llama with `sparse_prefill: false`: the prompt through the dense kernels, then decode steps
    that evict from the mass it left, give the chunked path's logits and statistics."""
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    runs = []
    for kernel in (False, True):
        model = tiny_llama().to(DEVICE)
        apply_attention(model, "h2o", budget=24, sink=2, local=8, sparse_prefill=False)
        for layer in model.model.layers:
            prefill_by(getattr(layer.self_attn, MODULE_ATTRIBUTE).method, kernel)
        runs.append(prefill_then_decode(model, ids, 60))
    (logits_ref, stats_ref), (logits, stats) = runs
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)
    assert stats == stats_ref


COMPILE = """
import json
from tests.kernels.sm90 import shared_bytes
from nsa_eval.baseline_kernels import h2o_dense as hd
out = {}
for dtype in ("bf16", "fp32"):
    p = "*" + dtype
    consts = dict(D=64, BD=64, BK=hd.MASS_KEYS, BQ=hd.MASS_QUERIES, UPCAST=False)
    out[f"mass {dtype}"] = shared_bytes(hd._key_mass_kernel, [p, p, "*fp32", "*fp32"], consts,
                                        dict(num_warps=hd.MASS_WARPS))
    consts = dict(D=64, DV=64, BD=64, BDV=64, BT=hd.FWD_ROWS, BN=hd.FWD_KEYS, UPCAST=False)
    options = dict(num_warps=hd.FWD_WARPS, num_stages=1 if dtype == "fp32" else 2)
    out[f"forward {dtype}"] = shared_bytes(hd._lse_fwd_kernel, [p] * 4 + ["*fp32"], consts, options)
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90():
    """Both kernels at a 1B Llama's head dim compile for sm_90 (no GPU needed) within the H200's shared
    memory, in bf16 and float32."""
    from tests.kernels.sm90 import H200_SHARED_LIMIT, json_from_fresh_python

    shared = json_from_fresh_python(COMPILE)
    assert len(shared) == 4
    assert max(shared.values()) <= H200_SHARED_LIMIT, shared


# ----------------------------------------------------------------------------------------------------------
# At scale, on a GPU: a Llama-3.2-1B layer (32/8 heads, d = 64)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_sdpa_lse_is_taken_and_matches():
    """On the GPU the forward is SDPA's own kernel asked for its lse (no fallback warning), and its out and
    lse agree with the Triton forward's at 4k."""
    import warnings

    from tests.methods.test_h2o_fast import llama_layer_qkv

    q, k, v = llama_layer_qkv(4096)
    backend = hd._sdpa_backend(q, k, v, 0.125)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = hd._sdpa_lse(q, k, v, 0.125)
    assert got is not None, backend
    out, lse = got
    out_t, lse_t = hd.attention_lse_triton(q, k, v, 0.125)
    print(f"\nSDPA backend {backend.name}: lse max diff {(lse - lse_t).abs().max().item():.2e}")
    assert (lse - lse_t).abs().max() < 1e-3
    assert rel_rms(out, out_t) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4096, 8192])
def test_gpu_dense_prefill_matches_chunked_path(T):
    """`sparse_prefill: false` on one layer call at scale: the kernels' output, mass and statistics against
    the chunked path's."""
    from tests.methods.test_h2o_fast import llama_layer_qkv

    q, k, v = llama_layer_qkv(T)
    (out_ref, mass_ref, stats_ref), (out, mass, stats) = (
        layer_call(q, k, v, 2560, 128, 512, kernel, G=4) for kernel in (False, True))
    assert rel_rms(out, out_ref) < 1e-2
    assert rel_rms(mass, mass_ref) < 1e-4
    assert stats == stats_ref


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8192, 32768])
def test_gpu_mass_sweep(T):
    """Prints the dense prefill's parts per 1B layer call beside SDPA: the forward with its lse (SDPA's own
    kernel, and the Triton fallback) and the mass pass at a few launches (keys held, queries a step,
    warps). The mass pass does one exp2 per score, as the forward does: about half the forward's time is
    its floor where exp2 bounds both."""
    import functools

    import torch.nn.functional as F

    from tests.methods.budget_inputs import cuda_ms
    from tests.methods.test_h2o_fast import llama_layer_qkv

    q, k, v = llama_layer_qkv(T)
    sdpa = cuda_ms(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True,
                                     enable_gqa=True))
    lse_ms = cuda_ms(functools.partial(hd.attention_lse, q, k, v, 0.125))
    triton_ms = cuda_ms(functools.partial(hd.attention_lse_triton, q, k, v, 0.125))
    print(f"\nT={T}: SDPA causal {sdpa:.2f} ms; with lse {lse_ms:.2f} ms ({lse_ms / sdpa:.2f}x), Triton "
          f"forward {triton_ms:.2f} ms ({triton_ms / sdpa:.2f}x)")
    _, lse = hd.attention_lse(q, k, v, 0.125)
    for bk, bq, warps in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (64, 32, 4), (32, 64, 4), (64, 64, 8)):
        ms = cuda_ms(functools.partial(hd.key_mass, q, k, lse, 0.125, block_keys=bk, block_queries=bq,
                                       num_warps=warps))
        print(f"  mass pass keys={bk} queries={bq} warps={warps}: {ms:.2f} ms ({ms / sdpa:.2f}x SDPA)")

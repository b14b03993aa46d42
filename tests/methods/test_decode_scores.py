"""The decode score kernel (nsa_eval/baseline_kernels/decode_scores.py) against its PyTorch reference: float32
`q . k` of one query per head against half-precision keys, read through a static cache's strided view. On
the CPU it runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py); the `gpu` test runs it at
Llama-3.2-1B's shape on CUDA."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.baseline_kernels.decode_scores import decode_scores, decode_scores_reference
from nsa_eval.methods.base import Chunk, grouped_scores
from tests.methods.budget_inputs import cuda_ms, interpreter_only
from tests.methods.interpreter_bounds import in_bounds

CASES = [  # (B, Hq, Hkv, W, D, dtype)
    (2, 4, 2, 300, 64, torch.bfloat16),  # W not a multiple of the 128-key tiles
    (1, 3, 1, 50, 16, torch.float16),  # G = 3
    (1, 4, 4, 129, 20, torch.bfloat16),  # G = 1, D not a power of two
    (3, 8, 2, 128, 32, torch.float32),
]
IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-W{c[3]}-D{c[4]}-{str(c[5])[6:]}" for c in CASES]


def inputs(B, Hq, Hkv, W, D, dtype, device="cpu", seed=0):
    """q `[B, Hq, 1, D]` as a model's transposed projection, k the first W slots of a `[B, Hkv, W + 40, D]`
    cache buffer (the strides of a static cache's view)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(B, 1, Hq, D, generator=g, device=device) * 2).to(dtype).transpose(1, 2)
    buffer = (torch.randn(B, Hkv, W + 40, D, generator=g, device=device) * 2).to(dtype)
    return q, buffer[:, :, :W]


@interpreter_only
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_scores_match_the_reference(case):
    q, k = inputs(*case)
    with in_bounds():
        scores = decode_scores(q, k, 0.125)
    assert scores.shape == (case[0], case[1], 1, case[3]) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, decode_scores_reference(q, k, 0.125), rtol=1e-5, atol=1e-5)


@interpreter_only
def test_a_key_s_score_does_not_depend_on_the_width():
    """The eager step scores S keys, the static step the W >= S slots of its width: the same bits where
    they overlap, so both rank the keys alike."""
    q, k = inputs(2, 4, 2, 300, 64, torch.bfloat16, seed=1)
    wide = decode_scores(q, k, 0.125)
    for S in (1, 77, 128, 299):
        assert torch.equal(decode_scores(q, k[:, :, :S].contiguous(), 0.125), wide[..., :S])


def test_bad_shapes_are_refused():
    q, k = inputs(1, 4, 2, 16, 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"q \[B, Hq, 1, D\]"):
        decode_scores(q.expand(1, 4, 2, 8), k, 1.0)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        decode_scores(q[:, :3], k, 1.0)


def test_cpu_logits_stay_the_float32_gemm():
    """Off the GPU a decode chunk's logits are the float32 product of the upcast keys, bit for bit."""
    q, k = inputs(2, 4, 2, 40, 16, torch.bfloat16)
    chunk = Chunk(q, k, 0.25, torch.zeros(2, 1, dtype=torch.long), torch.arange(40).expand(2, 40),
                  torch.ones(2, 1, 40, dtype=torch.bool))
    assert torch.equal(chunk.logits, grouped_scores(q.float(), k.float()) * 0.25)


@pytest.mark.gpu
def test_gpu_scores_at_llama_1b_shape():
    """Llama-3.2-1B's decode (32 query and 8 KV heads, D = 64) against a 32k-slot width of a bf16 cache: the
    reference's scores to float32 rounding, and the kernel's time against the upcast and GEMM (printed)."""
    q, k = inputs(1, 32, 8, 32768, 64, torch.bfloat16, device="cuda")
    scores = decode_scores(q, k, 0.125)
    reference = decode_scores_reference(q, k, 0.125)
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-4)
    for S in (20001, 32768):  # an eager step's contiguous keys: the static step's bits (the same selection)
        assert torch.equal(decode_scores(q, k[:, :, :S].contiguous(), 0.125), scores[..., :S])
    kernel_ms = cuda_ms(lambda: decode_scores(q, k, 0.125), n=20)
    reference_ms = cuda_ms(lambda: decode_scores_reference(q, k, 0.125), n=20)
    print(f"decode scores, 32 heads x 32k bf16 keys: kernel {kernel_ms:.3f} ms, upcast + GEMM "
          f"{reference_ms:.3f} ms")

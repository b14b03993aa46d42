"""The NSA model's memory on the GPU at Llama-3.2-1B's shape (16 layers, 32 query / 8 KV heads of 64,
bf16), against a Llama of the same shape: the cache after a 32k prefill at most 1.1x the Llama's
DynamicCache, the prefill's peak above the weights at most 1.2x, and a batch of 16 at 64k that
prefills and decodes on an 80 GB card. Run with `pytest -m gpu -s tests/models/test_gpu_memory.py`
(prints the figures)."""

from __future__ import annotations

import gc

import pytest
import torch

from nsa_eval.models.modeling_nsa import CACHE_FIELD
from tests.models.test_nsa_memory import dynamic_cache_bytes

pytestmark = pytest.mark.gpu

GIB = 2**30
SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
             tie_word_embeddings=True)  # as nsa_eval.bench.harness writes its checkpoints


def build(kind: str, max_length: int):
    """A random bf16 Llama or NSA model (the paper's NSA sizes, NSAConfig's defaults) on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nsa_eval.models.configuration_nsa import NSAConfig
    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    config, model = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (NSAConfig, NSAForCausalLM)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return model(config(**SHAPE, max_position_embeddings=max_length)).to(torch.bfloat16).eval()


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def prefill_memory(kind: str, ids: torch.Tensor) -> tuple[int, int]:
    """(bytes of the cache after a prefill of `ids`, the prefill's peak bytes above what the weights and
    the inputs hold), for the logits of the last position as generate() asks for them."""
    model = build(kind, ids.shape[1] + 64)
    release()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True, logits_to_keep=1), CACHE_FIELD)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    held = cache.nbytes() if kind == "nsa" else dynamic_cache_bytes(cache)
    del model, cache
    release()
    return held, peak


@pytest.mark.parametrize("length", [32768, 65536])
def test_cache_and_prefill_peak_against_full_attention(length):
    """Batch 1: the NSA cache at most 1.1x the Llama's (the floor is 1 + 1/16 compressed + (512 + 32) /
    T tokens of rings: 1.079 at 32k, 1.071 at 64k), the prefill's peak at most 1.2x."""
    ids = torch.randint(3, 8192, (1, length), device="cuda")
    cache = {}
    peak = {}
    for kind in ("llama", "nsa"):
        cache[kind], peak[kind] = prefill_memory(kind, ids)
    cache_ratio, peak_ratio = cache["nsa"] / cache["llama"], peak["nsa"] / peak["llama"]
    print(f"\n{length} tokens: cache NSA {cache['nsa'] / GIB:.3f} GiB, Llama {cache['llama'] / GIB:.3f} GiB "
          f"({cache_ratio:.3f}x); prefill peak above the weights NSA {peak['nsa'] / GIB:.3f} GiB, Llama "
          f"{peak['llama'] / GIB:.3f} GiB ({peak_ratio:.3f}x)")
    assert cache_ratio <= 1.1
    assert peak_ratio <= 1.2


def test_batch_16_at_64k_decodes():
    """16 prompts of 65,536 tokens prefill (a row at a time) and decode 8 greedy tokens through the CUDA
    graph on one card; prints the cache and the peak (the Llama's cache alone would be 32 GiB, its
    prefill's MLP intermediates for all 16 rows at once 48 GiB more)."""
    length, batch = 65536, 16
    model = build("nsa", length + 64)
    release()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(3, 8192, (batch, length), device="cuda")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             return_dict_in_generate=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, CACHE_FIELD)
    peak = torch.cuda.max_memory_allocated()
    print(f"\nbatch {batch} x {length}: cache {cache.nbytes() / GIB:.2f} GiB (capacity {cache.capacity}), "
          f"peak {peak / GIB:.2f} GiB of {torch.cuda.get_device_properties(0).total_memory / GIB:.1f}")
    assert out.sequences.shape == (batch, length + 8)
    assert cache.decode_graph is not None  # the steps after the first replayed a graph

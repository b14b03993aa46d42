"""The NSA model's memory: what its cache holds (per layout, to the byte, against a Llama's cache of the
same shape) and a batch of prompts prefilled a group of rows at a time, with the same logits, cache and
statistics as all rows at once. The GPU's figures (1B shape, 32k): tests/models/test_gpu_memory.py."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.models import modeling_nsa
from nsa_eval.models.cache_nsa import num_compressed, round_capacity
from nsa_eval.models.modeling_nsa import CACHE_FIELD, NSAForCausalLM
from tests.models.conftest import tiny_nsa_config
from tests.models.test_modeling_nsa import LAYOUTS, build, step_by_step_logits


def cache_floor_bytes(config, B: int, T: int, element: int = 4) -> int:
    """What the NSA cache must hold after T tokens: per layer the selection keys/values of every token
    (room for `round_capacity(T)`), the window's own keys/values for `window` tokens, the compressed
    blocks (and the spare row), the compression inputs of `block_len` tokens."""
    c = config
    D = c.num_key_value_heads * (c.head_dim + c.v_head_dim) * element  # bytes of one token's K and V
    capacity = round_capacity(T)
    own_window = c.window if not c.shared_kv and c.window > 0 else 0
    tokens = capacity + own_window + num_compressed(capacity, c.block_len, c.stride) + 1 + c.block_len
    return B * c.num_hidden_layers * tokens * D


@pytest.mark.parametrize("layout", [*LAYOUTS, "fla_no_window", "num_local_0"])
def test_cache_holds_the_floor_for_every_layout(layout):
    """Per layer: full-length selection keys/values, a ring of `window` rows for the window's own (paper
    layout only; fla's and window 0 have none), compressed blocks, a ring of `block_len` compression
    inputs; nothing else, to the byte."""
    more = {"fla_no_window": dict(LAYOUTS["fla"], window=0), "num_local_0": dict(num_init=0, num_local=0)}
    config = tiny_nsa_config(**more.get(layout, LAYOUTS.get(layout, {})))
    torch.manual_seed(0)
    model = NSAForCausalLM(config).eval()
    with torch.no_grad():
        cache = getattr(model(torch.randint(0, 97, (2, 37)), use_cache=True), CACHE_FIELD)
    assert cache.nbytes() == cache_floor_bytes(config, 2, 37)
    own_window = not config.shared_kv and config.window > 0
    for layer in cache.layers:
        assert (layer.k_swa is not None) == own_window
        if own_window:
            assert layer.k_swa.shape[1] == layer.v_swa.shape[1] == config.window
        assert layer.k_cmp_in.shape[1] == config.block_len


def test_window_ring_holds_the_last_window_keys():
    """Row p % window of the ring holds the window keys/values of token p, for the last `window` tokens,
    after a prefill and after decoding past several wraps: those a prefill over all tokens computes."""
    model = build("paper")  # window 8
    W, T = model.config.window, 30
    ids = torch.randint(0, 97, (2, T))
    inputs = {}
    hooks = [layer.attn.register_forward_pre_hook(lambda mod, args: inputs.setdefault(mod.layer_idx, args[0]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(ids, use_cache=False)
        for h in hooks:
            h.remove()
        stepped = getattr(model(ids[:, :5], use_cache=True), CACHE_FIELD)
        for t in range(5, T):
            model(ids[:, t : t + 1], cache=stepped)
        whole = getattr(model(ids, use_cache=True), CACHE_FIELD)
        for i, layer in enumerate(model.model.layers):
            p = layer.attn.project(inputs[i], torch.arange(T))
            last = torch.arange(T - W, T)
            for cache in (whole, stepped):
                for name in ("k_swa", "v_swa"):
                    ring = getattr(cache.layers[i], name)
                    torch.testing.assert_close(ring[:, last % W], p[name][:, last], atol=1e-5, rtol=1e-4)


def llama_cache_bytes(config, ids: torch.Tensor) -> int:
    """Bytes of the keys/values a Llama of the NSA model's widths holds after prefilling `ids`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    widths = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim")
    llama = LlamaForCausalLM(LlamaConfig(**{name: getattr(config, name) for name in widths},
                                         max_position_embeddings=ids.shape[1])).eval()
    with torch.no_grad():
        return dynamic_cache_bytes(getattr(llama(ids, use_cache=True), CACHE_FIELD))


def dynamic_cache_bytes(cache) -> int:
    """Bytes of the keys and values in transformers' DynamicCache."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))


def test_cache_against_a_llama_cache_at_the_paper_sizes():
    """The paper's blocks and a 64-token window at 4,096 tokens: the NSA cache holds 1 + 1/16 (the
    compressed blocks) + (64 + 32) / 4096 (the rings) of the Llama's, under 1.1x; the paper's 512-token
    window is 1/8 of 4,096 tokens (the GPU test measures it at 32k)."""
    config = tiny_nsa_config(block_len=32, stride=16, select_size=64, num_selected=4, window=64,
                             max_position_embeddings=4096)
    torch.manual_seed(0)
    model = NSAForCausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 4096))
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True), CACHE_FIELD)
    full = llama_cache_bytes(config, ids)
    ratio = cache.nbytes() / full
    tc = num_compressed(4096, 32, 16)
    assert ratio == pytest.approx((4096 + 64 + tc + 1 + 32) / 4096)
    assert ratio < 1.1


@pytest.mark.parametrize("layout", ["paper", "fla", "num_local_0"])
def test_prefill_in_groups_of_rows_equals_all_rows_at_once(layout, monkeypatch):
    """A batch of 5 prompts of 13 tokens with room for 2 rows a group (three groups, the last of one row):
    the same logits, cache buffers and statistics as one forward over all rows, then the same decode."""
    overrides = dict(num_init=0, num_local=0) if layout == "num_local_0" else LAYOUTS[layout]
    torch.manual_seed(0)
    model = NSAForCausalLM(tiny_nsa_config(**overrides)).eval()
    ids = torch.randint(0, 97, (5, 20))
    runs = {}
    for tokens in (10**6, 26):
        monkeypatch.setattr(modeling_nsa, "PREFILL_TOKENS", tokens)
        model.reset_attention_stats()
        with torch.no_grad():
            logits = step_by_step_logits(model, ids, 13)
            cache = getattr(model(ids[:, :13], use_cache=True), CACHE_FIELD)
        runs[tokens] = logits, cache, model.attention_stats()
    (logits, cache, stats), (grouped, grouped_cache, grouped_stats) = runs[10**6], runs[26]
    torch.testing.assert_close(grouped, logits, atol=1e-6, rtol=1e-5)
    assert grouped_stats == stats
    for a, b in zip(grouped_cache.layers, cache.layers, strict=True):
        assert a.tensors() == b.tensors()
        for name in a.tensors():
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-6, rtol=1e-5)



@pytest.mark.slow
def test_prefill_attention_holds_no_more_than_the_mlp(monkeypatch):
    """The prefill's transient memory, counted tensor by tensor (`LiveBytes`) through the Triton kernels
    (the interpreter on a CPU): a layer's NSA attention holds no more above its input than its MLP
    does (12 hidden states: gate, up and their product at 4x the width), so the prefill peaks where a
    Llama's does, in the MLP, above a cache of about full attention's size.

    The model is the 1B shape scaled down (hidden 128 = 8 query heads x 16, 2 KV heads, MLP 4x, 16
    selected blocks of 64) with the kernels' paths and chunk limits of 32k tokens scaled with it: the
    forward per key block, importances in chunks of one hidden state's bytes, partials of two. Without
    the chunks the attention held 24 hidden states (its partials alone 16)."""
    from nsa_eval.kernels import importance, selected_by_block, selection
    from tests.models.live_bytes import LiveBytes

    T, C = 256, 128
    hidden_state = T * C * 4  # bytes of one [1, T, C] float32 tensor
    monkeypatch.setattr(selection, "SELECTED_BY_BLOCK_MIN_ROWS", 0)  # the 1B shape's path from 8k up
    monkeypatch.setattr(importance, "IMPORTANCE_CHUNK_BYTES", hidden_state)  # 128 MiB at 32k
    monkeypatch.setattr(selected_by_block, "PARTIALS_CHUNK_BYTES", 2 * hidden_state)  # 256 MiB at 32k
    config = tiny_nsa_config(hidden_size=C, intermediate_size=4 * C, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=16, block_len=32,
                             stride=16, select_size=64, num_selected=16, window=64, kernel_impl="triton",
                             max_position_embeddings=T)
    torch.manual_seed(0)
    model = NSAForCausalLM(config).eval()
    held = {"attn": [], "mlp": []}
    sections = []
    for name, module in (("attn", model.model.layers[0].attn), ("mlp", model.model.layers[0].mlp)):
        def enter(module, args, name=name):
            sections.append(counter.section(held[name]))
            sections[-1].__enter__()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda module, args, out: sections.pop().__exit__(None, None, None))
    with torch.no_grad(), LiveBytes() as counter:
        cache = getattr(model(torch.randint(0, 97, (1, T)), use_cache=True, logits_to_keep=1), CACHE_FIELD)
    attention = held["attn"][0] - cache.nbytes()  # the layer's cache is allocated inside its attention
    print(f"\nheld above the input, in hidden states: attention {attention / hidden_state:.2f} (+ its cache "
          f"{cache.nbytes() / hidden_state:.2f}), MLP {held['mlp'][0] / hidden_state:.2f}; prefill peak "
          f"{counter.peak / hidden_state:.2f}")
    assert held["mlp"][0] == 12 * hidden_state
    assert attention <= held["mlp"][0]

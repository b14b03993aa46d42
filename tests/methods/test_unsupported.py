"""What the methods cannot run on fails early with a UsageError: caches other than a plain
DynamicCache of full-attention layers, and models with an active sliding window."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.errors import UsageError
from nsa_eval.methods import apply_attention, attention_stats, check_model_config
from tests.methods.conftest import ALL_METHODS, SPARSE_METHODS, tiny_llama

IDS = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def small():
    return tiny_llama()


def _mistral(sliding_window):
    """A random 2-layer MistralForCausalLM, with sharp attention like `tiny_llama`."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=sliding_window,
        pad_token_id=0,
    )
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


# ---- caches ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
def test_static_cache_generate_is_refused(small, method):
    """generate(cache_implementation="static") hands attention the whole preallocated cache: refused."""
    apply_attention(small, method, budget=64, sink=4, local=8)
    with torch.no_grad(), pytest.raises(UsageError) as err:
        small.generate(IDS, max_new_tokens=4, do_sample=False, cache_implementation="static")
    message = str(err.value)
    assert "StaticCache" in message and "a dynamic cache is expected" in message
    assert attention_stats(small)["queries"] == 0  # refused before any attention ran


def test_static_cache_forward_is_refused(small):
    from transformers import StaticCache

    apply_attention(small, "h2o", budget=16, sink=2, local=4)
    cache = StaticCache(config=small.config, max_cache_len=64)
    with torch.no_grad(), pytest.raises(UsageError, match="got a StaticCache as its KV cache"):
        small(IDS, cache=cache, use_cache=True)


def test_sliding_window_cache_is_refused(small):
    """A DynamicCache whose layers drop old keys (DynamicSlidingWindowLayer) is refused too."""
    from transformers import DynamicCache

    cache = DynamicCache(config=_mistral(sliding_window=8).config)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    apply_attention(small, "topk", budget=16, sink=2, local=4)
    with torch.no_grad(), pytest.raises(UsageError, match="DynamicSlidingWindowLayer layers"):
        small(IDS, cache=cache, use_cache=True)


def test_plain_dynamic_caches_work(small):
    """generate()'s default cache and a DynamicCache built from the model's config both pass."""
    from transformers import DynamicCache

    apply_attention(small, "full")
    with torch.no_grad():
        ref = small(IDS).logits
    apply_attention(small, "h2o", budget=64, sink=4, local=8)  # budget covers every key: full attention
    for cache in (DynamicCache(), DynamicCache(config=small.config)):
        with torch.no_grad():
            out = small(IDS[:, :30], cache=cache, use_cache=True)
            step = small(IDS[:, 30:], cache=out.cache, use_cache=True)
        torch.testing.assert_close(step.logits, ref[:, 30:], rtol=1e-4, atol=1e-4)


# ---- sliding-window models ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
def test_active_sliding_window_model_is_refused(method):
    model = _mistral(sliding_window=32)
    before = model.config._attn_implementation
    with pytest.raises(UsageError, match=r"active sliding attention window \(sliding_window=32\)"):
        apply_attention(model, method, budget=40, sink=4, local=16)
    assert model.config._attn_implementation == before  # refused before the model was touched


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_full_attention_mistral_works(method):
    """Mistral with sliding_window=None: prefill + decode equals one pass, as for Llama."""
    model = _mistral(sliding_window=None)
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(3))
    params = {"page_size": 4} if method == "quest" else {}
    apply_attention(model, method, budget=20, sink=4, local=8, **params)
    with torch.no_grad():
        one = model(ids).logits
        out = model(ids[:, :60], use_cache=True)
        steps = []
        for t in range(60, 70):
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), one[:, 60:], rtol=1e-4, atol=1e-4)
    assert attention_stats(model)["held"]["max"] == (12 if method == "sink_window" else 20)


def _qwen2(**kwargs):
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=4, **kwargs)


@pytest.mark.parametrize(
    "config, message",
    [
        (_qwen2(use_sliding_window=True, sliding_window=64, max_window_layers=2), "sliding_attention"),
        (_qwen2(use_sliding_window=True, sliding_window=64, max_window_layers=0), "layers [0, 1, 2, 3]"),
    ],
)
def test_qwen_sliding_layers_are_refused(config, message):
    with pytest.raises(UsageError, match="active sliding attention window") as err:
        check_model_config(config)
    assert message in str(err.value)


def test_full_attention_configs_pass():
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    check_model_config(LlamaConfig())
    check_model_config(MistralConfig(sliding_window=None))
    check_model_config(_qwen2())  # use_sliding_window=False by default
    # window on, but no layer at or past max_window_layers=4: every layer is full attention
    check_model_config(_qwen2(use_sliding_window=True, sliding_window=64, max_window_layers=4))
    check_model_config(Qwen3Config(num_hidden_layers=2))


def test_config_json_dicts_are_checked():
    """The dict of a checkpoint's config.json works too (what a loader has before the weights)."""
    from transformers import MistralConfig

    with pytest.raises(UsageError, match=r"sliding_window=4096"):
        check_model_config(MistralConfig(sliding_window=4096).to_dict())
    check_model_config(MistralConfig(sliding_window=None).to_dict())
    check_model_config(_qwen2().to_dict())
    # Qwen2's config.json: the window is set but off
    check_model_config({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 131072})
    with pytest.raises(UsageError, match="sliding_attention"):
        check_model_config(
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
        )
    with pytest.raises(UsageError, match="sliding_window=64"):
        check_model_config({"model_type": "not-a-transformers-model", "sliding_window": 64})

"""Bad input fails early with one clear message; a query over budget fails loudly."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nsa_eval.errors import UsageError
from nsa_eval.methods import METHODS, BudgetExceededError, apply_attention, attention_stats
from nsa_eval.methods.base import AttentionMethod, BudgetConfig
from nsa_eval.methods.controller import AttentionController
from tests.methods.conftest import fake_module, random_qkv, tiny_llama


@pytest.fixture(scope="module")
def small():
    return tiny_llama(layers=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "topkk"}, "did you mean 'topk'"),
        ({"method": "nope"}, "full, h2o, quest, sink_window, topk"),
        ({"method": "topk", "budget": 100, "sink": 64, "local": 64}, "at least sink + local"),
        ({"method": "topk", "window": 3}, "unknown parameter(s) 'window'"),
        ({"method": "h2o", "page_size": 16}, "expected some of: group_shared, query_chunk"),
        ({"method": "quest", "page_size": 0}, "page_size"),
        ({"method": "quest", "budget": 12, "sink": 0, "local": 8}, "local >= page_size"),
        ({"method": "topk", "budget": -1}, "budget must be an integer >= 1"),
        ({"method": "topk", "local": 0}, "local must be an integer >= 1"),
        ({"method": "topk", "sink": 1.5}, "sink must be an integer"),
        ({"method": "topk", "sparse_prefill": "yes"}, "sparse_prefill must be True or False"),
        ({"method": "topk", "dense_layers": 5}, "exceeds the model's 1 layers"),
        ({"method": "topk", "query_chunk": 0}, "query_chunk"),
    ],
)
def test_bad_input(small, kwargs, message):
    with pytest.raises(UsageError) as err:
        apply_attention(small, **kwargs)
    assert message in str(err.value)


def test_registry_names():
    assert METHODS.names() == ["full", "h2o", "quest", "sink_window", "topk"]


def test_stats_and_models_need_apply_attention():
    from transformers import LlamaConfig, LlamaForCausalLM

    fresh = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(UsageError, match="apply_attention"):
        attention_stats(fresh)
    with pytest.raises(UsageError, match="Llama-style attention"):
        apply_attention(torch.nn.Linear(2, 2), "full")


@dataclass
class _Greedy(AttentionMethod):
    """A broken method that keeps every visible key: the budget check must catch it."""

    name = "greedy"

    def score(self, chunk):
        return chunk.logits

    def forced(self, chunk):
        return chunk.visible


def test_over_budget_fails_loudly():
    controller = AttentionController(_Greedy(), BudgetConfig(budget=16, sink=2, local=4))
    q, k, v = random_qkv(T=40)
    with pytest.raises(BudgetExceededError, match="over the budget of 16"):
        controller.attend(fake_module(), q, k, v, None, None)


def test_h2o_refuses_a_cache_it_did_not_fill(small):
    ids = torch.randint(3, 128, (1, 40))
    apply_attention(small, "h2o", budget=16, sink=2, local=4)
    with torch.no_grad():
        out = small(ids, use_cache=True)
        apply_attention(small, "h2o", budget=16, sink=2, local=4)  # a new method instance mid-sequence
        with pytest.raises(RuntimeError, match="no state for the 40 cached keys"):
            small(ids[:, :1], cache=out.cache, use_cache=True)

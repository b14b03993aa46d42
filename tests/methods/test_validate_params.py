"""`validate_params` checks a method's parameters without a model, with apply_attention's own messages,
so the loader can stop a typo before the weights load."""

from __future__ import annotations

import json

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.methods import apply_attention, validate_params
from nsa_eval.methods.quest import Quest
from tests.methods.conftest import tiny_llama

BAD = [
    ("quest", {"page_sise": 16}, "unknown parameter(s) 'page_sise'"),
    ("quest", {"page_size": 0}, "page_size must be a positive integer"),
    ("topk", {"query_chunk": 0}, "query_chunk"),
    ("topk", {"budget": 100, "sink": 64, "local": 64}, "at least sink + local"),
    ("quest", {"budget": 12, "sink": 0, "local": 8}, "local >= page_size"),
    ("topkk", {}, "did you mean 'topk'"),
]


@pytest.fixture(scope="module")
def small():
    return tiny_llama(layers=1)


def _split(params):
    budget = {k: params.pop(k) for k in ("budget", "sink", "local") if k in params}
    return {"budget": 40, "sink": 4, "local": 8, **budget}, params


@pytest.mark.parametrize("method, params, message", BAD)
def test_same_error_as_apply_attention(small, method, params, message):
    budget, method_params = _split(dict(params))
    with pytest.raises(UsageError) as early:
        validate_params(method, **budget, **method_params)
    with pytest.raises(UsageError) as late:
        apply_attention(small, method, **budget, **method_params)
    assert message in str(early.value)
    assert str(early.value) == str(late.value)


def test_returns_the_method_and_needs_no_model():
    assert validate_params("quest", budget=40, sink=4, local=8, page_size=8) == Quest(page_size=8)
    assert validate_params("h2o", budget=2560, sink=128, local=512).name == "h2o"


def test_full_ignores_budget_sink_and_local(small):
    """`full` has no budget (README, docs/models.md): an impossible budget is not an error there."""
    validate_params("full", budget=10, sink=128, local=512)
    validate_params("full", budget=None, sink=None, local=None)
    apply_attention(small, "full", budget=10, sink=128, local=512)
    with pytest.raises(UsageError, match="unknown parameter"):
        validate_params("full", budget=10, sink=128, local=512, page_size=16)


@pytest.mark.parametrize("method, params, message", BAD[:2])
def test_loader_stops_before_the_weights(tmp_path, monkeypatch, method, params, message):
    """load_for_eval's early check is validate_params: the error comes before from_pretrained."""
    import transformers

    from nsa_eval.models import loading

    tiny_llama(layers=1).config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the method parameters were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(UsageError) as err:
        loading.load_for_eval(
            str(tmp_path), attention=method, budget=40, sink=4, local=8, method_params=dict(params)
        )
    with pytest.raises(UsageError) as direct:
        validate_params(method, budget=40, sink=4, local=8, **params)
    assert message in str(err.value) and str(err.value) == str(direct.value)

"""load_pretrained / load_for_eval: short names, checkpoint kinds, and errors before weights load."""

from __future__ import annotations

import json

import pytest
import torch

from nsa_eval.errors import UsageError
from nsa_eval.models import loading
from nsa_eval.models.loading import inspect_checkpoint, load_for_eval, load_pretrained, resolve_checkpoint


def test_load_nsa_directory_by_path(tiny_nsa_dir):
    model, tokenizer = load_pretrained(str(tiny_nsa_dir), dtype="float32")
    assert model.config.model_type == "nsa_eval" and not model.training
    ids = torch.tensor([tokenizer.encode("hello world")])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    assert inspect_checkpoint(tiny_nsa_dir).kind == "nsa"


def test_missing_directory_lists_what_is_expected(tmp_path):
    with pytest.raises(UsageError, match="does not exist.*smollm2-135m, nsa-tiny, full-tiny"):
        resolve_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match="no config.json"):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(UsageError, match="hub is offline"):
        resolve_checkpoint("some-org/some-model")  # tests run with HF_HUB_OFFLINE=1


def test_bundled_checkpoint_not_there_yet(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "CHECKPOINTS_DIR", tmp_path)
    with pytest.raises(UsageError, match="'nsa-tiny' is not bundled yet"):
        resolve_checkpoint("nsa-tiny")
    (tmp_path / "full-tiny").mkdir()
    (tmp_path / "full-tiny" / "config.json").write_text("{}")
    assert resolve_checkpoint("full-tiny") == tmp_path / "full-tiny"


def test_nsa_config_missing_fields(tiny_nsa_dir, tmp_path):
    config = json.loads((tiny_nsa_dir / "config.json").read_text())
    del config["block_len"], config["window"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="missing block_len, window"):
        load_pretrained(tmp_path)  # fails on config.json alone: there are no weights here
    config.update(block_len=8, window=8, stride=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="stride"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention="quest", budget=600, sink=128, local=512), "sink \\+ local"),
        (dict(attention="flash"), "unknown attention 'flash'"),
        (dict(attention="nsa"), "needs an NSA checkpoint"),
        (dict(attention="full", dtype="float64"), "dtype"),
    ],
)
def test_baseline_errors_before_weights_load(llama_config_dir, kwargs, message):
    with pytest.raises(UsageError, match=message):
        load_for_eval(llama_config_dir, **kwargs)  # the directory holds no weights at all

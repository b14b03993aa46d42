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


def test_missing_dir_slash_name_is_one_usage_error(tmp_path, monkeypatch):
    """`dir/name` that does not exist: a UsageError naming the value, never a hub traceback."""
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE  # tests/conftest.py: nothing here may reach a hub
    with pytest.raises(UsageError, match="'some/dir' is not a local directory and the hub is offline"):
        inspect_checkpoint("some/dir")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()  # an existing local parent: a path, refused without asking the hub
    with pytest.raises(UsageError, match="checkpoint directory 'ckpts/my-nsa' does not exist"):
        inspect_checkpoint("ckpts/my-nsa")
    # as if online: an invalid hub name fails at once, a failed hub lookup becomes one UsageError
    monkeypatch.setattr(loading, "_offline", lambda: False)
    with pytest.raises(UsageError, match="'my dir/x' is neither a local directory nor a valid hub name"):
        inspect_checkpoint("my dir/x")
    with pytest.raises(
        UsageError,
        match=r"'some/dir' is neither a local directory nor readable from the hub "
        r"\(offline.*expected a directory with config.json, a hub name",
    ) as err:
        inspect_checkpoint("some/dir")  # transformers honours HF_HUB_OFFLINE: OSError, no request
    assert "\n" not in str(err.value)


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


def test_nsa_num_selected_overrides_the_checkpoints_at_load(tiny_nsa_dir, monkeypatch):
    """The selection budget swept at inference: select_size 8, so queries before token 24 have at most
    3 blocks and every n selects them all; later queries see more blocks with n = 6 than with 3."""
    trained, tokenizer = load_for_eval(tiny_nsa_dir, attention="nsa", dtype="float32")
    wider, _ = load_for_eval(tiny_nsa_dir, attention="nsa", dtype="float32",
                             method_params={"num_selected": 6})
    assert (trained.config.num_selected, wider.config.num_selected) == (3, 6)
    ids = torch.randint(0, len(tokenizer), (1, 96), generator=torch.Generator().manual_seed(0))
    stats = []
    for model in (trained, wider):
        loading.reset_attention_stats(model)
        with torch.no_grad():
            stats.append((model(ids).logits, loading.attention_stats(model)))
    (a, trained_stats), (b, wider_stats) = stats
    torch.testing.assert_close(a[:, :24], b[:, :24])
    assert not torch.allclose(a[:, -1], b[:, -1])
    assert trained_stats["params"]["num_selected"] == 3 and wider_stats["params"]["num_selected"] == 6
    assert wider_stats["mean_per_branch"]["selected"] > trained_stats["mean_per_branch"]["selected"]
    # below the forced blocks (num_init 1 + num_local 2), or a setting the weights depend on: refused
    # before any weight is read
    monkeypatch.setattr(loading, "_load", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(UsageError, match=r"num_selected 2 is below the 3 blocks .*\(num_init 1 \+ num_"):
        load_for_eval(tiny_nsa_dir, attention="nsa", method_params={"num_selected": 2})
    with pytest.raises(UsageError, match="attention=nsa takes only num_selected .*; got window"):
        load_for_eval(tiny_nsa_dir, attention="nsa", method_params={"window": 4})


def test_fingerprint_follows_weights_config_and_tokenizer(tmp_path):
    """A cell's checkpoint identity: retrained weights, another config or another tokenizer (its chat
    template included) each give a new fingerprint; a README next to them does not."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ a }}"}))
    base = loading.checkpoint_fingerprint(tmp_path)
    (tmp_path / "README.md").write_text("notes")
    assert loading.checkpoint_fingerprint(tmp_path) == base
    prints = {base}
    for name, content in [
        ("tokenizer_config.json", json.dumps({"chat_template": "{{ b }}"})),
        ("chat_template.jinja", "{{ c }}"),
        ("config.json", json.dumps({"model_type": "llama", "num_hidden_layers": 2})),
    ]:
        (tmp_path / name).write_text(content)
        prints.add(loading.checkpoint_fingerprint(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 64)
    prints.add(loading.checkpoint_fingerprint(tmp_path))
    assert len(prints) == 5


@pytest.fixture
def yes_to_every_prompt(monkeypatch) -> list:
    """Answers yes on stdin (transformers' "run the custom code?" prompt) and records each question."""
    prompts: list = []
    monkeypatch.setattr("builtins.input", lambda prompt="": prompts.append(prompt) or "y")
    return prompts


def test_a_load_never_offers_to_run_remote_code(tmp_path, tiny_llama_dir, yes_to_every_prompt):
    """Left unset, trust_remote_code makes transformers ask on stdin and run an auto_map's code on a
    yes: a load without it refuses instead, for the model's config.json and the tokenizer's files."""
    import shutil

    from nsa_eval.tasks import niah

    ckpt = shutil.copytree(tiny_llama_dir, tmp_path / "ckpt")
    for module in ("configuration_mine", "modeling_mine", "tokenization_mine"):
        (ckpt / f"{module}.py").write_text("raise SystemExit('remote code ran')\n")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k != "model_type"}
        | {"auto_map": {"AutoConfig": "configuration_mine.MyConfig",
                        "AutoModelForCausalLM": "modeling_mine.MyModel"}}))
    with pytest.raises(ValueError, match="contains custom code"):
        load_pretrained(ckpt, dtype="float32")
    (ckpt / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        tokenizer_config | {"tokenizer_class": "MyTokenizer",
                            "auto_map": {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}}))
    with pytest.raises(UsageError) as err:
        load_pretrained(ckpt, dtype="float32")
    assert str(err.value).startswith(f"{ckpt}: no usable tokenizer (The repository {ckpt} contains custom "
                                     "code") and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="contains custom code"):
        niah.load_tokenizer(str(ckpt))  # the NIAH and LongBench tasks' tokenizer, and validate's
    assert yes_to_every_prompt == []

"""Suite files -> typed cells: expansion, labels, hashes, and one clear UsageError per bad suite."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.suite import check_suite, load_suite, parse_suite

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


BASE = """\
name: t
defaults: {pretrained: smollm2-135m, sink: 64, local: 256}
models:
  - attention: full
  - attention: [topk, quest]
    budget: [640, 1024]
tasks:
  - task: nsa_niah
    split: niah_lengths
    metadata: {niah_lengths: [1024, 2048], niah_depths: [0, 100]}
  - {task: nsa_mmlu, models: [full]}
"""


def test_models_expand_over_methods_and_budgets(tmp_path):
    suite = load_suite(write(tmp_path, BASE))
    assert [m.label for m in suite.models] == ["full", "topk@640", "topk@1024", "quest@640", "quest@1024"]
    assert suite.models[0].budget is None  # full attention has no budget
    assert suite.models[2].model_args()["budget"] == 1024
    cells = suite.cells()
    # niah is split by length for every model; mmlu only for `full`
    assert [c.label for c in cells[:3]] == ["full/nsa_niah@1024", "full/nsa_niah@2048", "full/nsa_mmlu"]
    assert len(cells) == 5 * 2 + 1
    assert cells[0].metadata()["niah_lengths"] == [1024]


def test_cell_keys_change_with_what_changes_numbers_only(tmp_path):
    suite = load_suite(write(tmp_path, BASE))
    keys = [c.key for c in suite.cells()]
    assert len(set(keys)) == len(keys)
    assert keys == [c.key for c in load_suite(write(tmp_path, BASE, "copy.yaml")).cells()]
    placed = BASE.replace("sink: 64", "sink: 64, device: cuda, batch_size: 4")
    moved = load_suite(write(tmp_path, placed, "m.yaml"))
    assert [c.key for c in moved.cells()] == keys  # placement is not hashed
    limited = [c.key for c in suite.cells(limit=3)]
    assert not set(limited) & set(keys)
    bigger = load_suite(write(tmp_path, BASE.replace("local: 256", "local: 128"), "b.yaml"))
    changed = [a != b for a, b in zip(keys, [c.key for c in bigger.cells()], strict=True)]
    assert changed[:3] == [False, False, False]  # full attention does not use `local`
    assert all(changed[3:])


def test_a_retrained_local_checkpoint_gets_new_cell_keys(tmp_path):
    import shutil

    from nsa_eval.models.loading import CHECKPOINTS_DIR

    ckpt = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINTS_DIR / "full-tiny", ckpt)
    text = BASE.replace("pretrained: smollm2-135m", f"pretrained: {ckpt}")
    before = [c.key for c in load_suite(write(tmp_path, text)).cells()]
    assert before == [c.key for c in load_suite(write(tmp_path, text, "again.yaml")).cells()]
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: a different model
    weights.write_bytes(bytes(data))
    after = [c.key for c in load_suite(write(tmp_path, text, "after.yaml")).cells()]
    assert not set(before) & set(after)


def test_only_filters_cells_and_rejects_a_pattern_matching_nothing(tmp_path):
    suite = load_suite(write(tmp_path, BASE))
    assert {c.label for c in suite.cells(only="quest@640/*")} == {"quest@640/nsa_niah@1024",
                                                                   "quest@640/nsa_niah@2048"}
    assert len(suite.cells(only="mmlu")) == 1  # no glob characters: substring
    with pytest.raises(UsageError, match="--only 'nothing' matches no cell"):
        suite.cells(only="nothing")


BAD_CASES = [
    # (replace this, with this, message fragments)
    ("name: t", "name: t\nmodles: []", ["models", "unknown key 'modles'", "did you mean 'models'"]),
    ("sink: 64,", "sink: 64, budgte: 3,", ["defaults.budgte", "unknown key 'budgte'"]),
    ("budget: [640, 1024]", "budget: [640, big]", ["models[1].budget", "expected integers"]),
    ("budget: [640, 1024]", "budget: 200", ["models[1].budget", "200 is below sink + local", "320"]),
    ("sink: 64,", "sink: 64, dtype: float8,", ["models[0].dtype", "unknown value 'float8'"]),
    ("- attention: full", "- attention: full\n    sparse_prefill: maybe",
     ["models[0].sparse_prefill", "expected true or false"]),
    ("  - {task: nsa_mmlu, models: [full]}", "  - {task: nsa_mmlu, models: [fulll]}",
     ["tasks[1].models", "'fulll' matches no model"]),
    ("  - {task: nsa_mmlu, models: [full]}", "  - {task: nsa_mmlu, num_fewshot: five}",
     ["tasks[1].num_fewshot", "expected an integer"]),
    ("    split: niah_lengths", "    split: niah_depth", ["tasks[0].split", "niah_depth"]),
    ("- attention: full", "- attention: topk\n    backend: vllm",
     ["models[0].backend", "full attention only"]),
    ("name: t", "name: t/x", ["name", "must be letters"]),
]


@pytest.mark.parametrize("old,new,fragments", BAD_CASES)
def test_bad_suite_names_file_and_key(tmp_path, old, new, fragments):
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(UsageError) as err:
        load_suite(path)
    message = str(err.value)
    assert message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(UsageError, match="no such suite file"):
        load_suite(tmp_path / "absent.yaml")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_suite(write(tmp_path, "name: [unclosed"))
    with pytest.raises(UsageError, match="missing key 'tasks'"):
        parse_suite({"name": "x", "models": [{"pretrained": "a", "attention": "full"}]}, "mem")


NAME_CASES = [
    ("attention: [topk, quest]", "attention: [topk, qeust]",
     ["attention", "unknown attention method 'qeust'"]),
    ("pretrained: smollm2-135m", "pretrained: /no/such/dir",
     ["pretrained", "/no/such/dir", "does not exist"]),
    ("    budget: [640, 1024]", "    budget: [640, 1024]\n    params: {page_sise: 8}",
     ["params", "unknown parameter(s) 'page_sise'"]),
]


@pytest.mark.parametrize("old,new,fragments", NAME_CASES)
def test_unknown_method_checkpoint_or_parameter_fail_before_loading(tmp_path, old, new, fragments):
    path = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(UsageError) as err:
        check_suite(load_suite(path), check_tasks=False, check_data=False)
    assert str(err.value).startswith(str(path))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_nsa_attention_needs_an_nsa_checkpoint(tmp_path):
    model = tmp_path / "llama"  # only config.json is read: nothing loads before the checks pass
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    text = BASE.replace("- attention: full", "- attention: full\n  - attention: nsa")
    path = write(tmp_path, text.replace("pretrained: smollm2-135m", f"pretrained: {model}"))
    with pytest.raises(UsageError, match="attention=nsa needs an NSA checkpoint"):
        check_suite(load_suite(path), check_tasks=False, check_data=False)


def test_vllm_backend_maps_arguments_and_says_when_missing(tmp_path):
    """vllm cannot be installed here: the argument mapping and the message are what we can test."""
    from nsa_eval.runner import vllm_model_args

    text = BASE.replace("- attention: full", "- attention: full\n    backend: vllm\n    max_length: 16384\n"
                        "    vllm: {tensor_parallel_size: 2, gpu_memory_utilization: 0.8}")
    suite = load_suite(write(tmp_path, text))
    args = vllm_model_args(suite.models[0], seed=7)
    assert args["max_model_len"] == 16384 and args["tensor_parallel_size"] == 2
    assert args["gpu_memory_utilization"] == 0.8 and args["seed"] == 7 and args["dtype"] == "auto"
    assert suite.models[0].identity()["backend"] == "vllm"  # a vllm cell never reuses an hf cell
    with pytest.raises(UsageError, match="vllm is not installed"):
        check_suite(suite, check_tasks=False, check_data=False)


def test_shipped_configs_parse():
    for name in ("quickstart", "paper", "budget_sweep"):
        suite = load_suite(CONFIGS / f"{name}.yaml")
        assert suite.name == name and suite.cells()
    sweep = load_suite(CONFIGS / "budget_sweep.yaml")
    assert {m.budget for m in sweep.models if m.attention == "quest"} == {640, 1280, 2560, 5120}

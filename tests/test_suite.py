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


def test_bootstrap_iters_changes_every_cell_key(tmp_path):
    """bootstrap_iters changes the stderr values of results.json, which the report shows."""
    keys = [c.key for c in load_suite(write(tmp_path, BASE)).cells()]
    fewer = BASE.replace("name: t", "name: t\nbootstrap_iters: 100")
    assert not set(keys) & {c.key for c in load_suite(write(tmp_path, fewer, "b.yaml")).cells()}
    same = BASE.replace("name: t", "name: t\nbootstrap_iters: 1000")  # the default, spelled out
    assert keys == [c.key for c in load_suite(write(tmp_path, same, "d.yaml")).cells()]


def include_path_keys(tmp_path: Path, tasks_dir: Path, name: str) -> list[str]:
    text = BASE.replace("name: t", f"name: t\ninclude_path: {tasks_dir}")
    return [c.key for c in load_suite(write(tmp_path, text, name)).cells()]


def test_include_path_contents_change_cell_keys(tmp_path):
    import shutil

    tasks = tmp_path / "tasks"
    (tasks / "sub").mkdir(parents=True)
    (tasks / "mine.yaml").write_text("task: mine\ndataset_path: json\n")
    (tasks / "sub" / "utils.py").write_text("def process(doc):\n    return doc\n")
    plain = [c.key for c in load_suite(write(tmp_path, BASE)).cells()]
    before = include_path_keys(tmp_path, tasks, "a.yaml")
    assert not set(before) & set(plain)
    assert include_path_keys(tmp_path, tasks, "again.yaml") == before
    (tasks / "sub" / "__pycache__").mkdir()
    (tasks / "sub" / "__pycache__" / "utils.cpython-311.pyc").write_bytes(b"\0")
    (tasks / "sub" / "stale.pyc").write_bytes(b"\0")
    assert include_path_keys(tmp_path, tasks, "pyc.yaml") == before  # Python's own files
    for hidden in (".git", "sub/.hidden"):
        (tasks / hidden).mkdir()
        (tasks / hidden / "HEAD").write_text("ref: refs/heads/main")
    (tasks / ".mine.yaml.swp").write_bytes(b"\0")
    for output, name in (("runs/x", "run.json"), ("reports/x", "report.json")):  # nsa-eval's own
        (tasks / output).mkdir(parents=True)
        (tasks / output / name).write_text("{}")
        (tasks / output / "cells.json").write_text("[]")
    assert include_path_keys(tmp_path, tasks, "unread.yaml") == before
    moved = shutil.copytree(tasks, tmp_path / "elsewhere" / "tasks")
    assert include_path_keys(tmp_path, moved, "moved.yaml") == before  # relative paths only
    (tasks / "sub" / "utils.py").write_text("def process(doc):\n    return {}\n")
    edited = include_path_keys(tmp_path, tasks, "edited.yaml")
    assert not set(edited) & set(before)
    (tasks / "extra.txt").write_text("a new file the task may read")
    added = include_path_keys(tmp_path, tasks, "added.yaml")
    assert not set(added) & set(edited)
    (tasks / "sub" / ".hidden" / "hidden_task.yaml").write_text("task: hidden\ndataset_path: json\n")
    assert not set(include_path_keys(tmp_path, tasks, "hidden.yaml")) & set(added)  # lm-eval indexes it


def test_include_path_fingerprint_is_read_once_and_only_with_include_path(tmp_path, monkeypatch):
    from nsa_eval.suite import spec

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: mine\n")
    calls = []
    real = spec.include_path_fingerprint
    monkeypatch.setattr(spec, "include_path_fingerprint", lambda p: calls.append(p) or real(p))
    text = BASE.replace("name: t", f"name: t\ninclude_path: {tasks}")
    suite = load_suite(write(tmp_path, text))
    cells = suite.cells() + suite.cells(limit=2)
    assert len({c.key for c in cells} | {c.key for c in cells}) == len(cells)
    assert len(calls) == 1  # once per suite, not once per cell or per `key`
    assert "include_path" in cells[0].identity()
    plain = load_suite(write(tmp_path, BASE, "plain.yaml"))
    assert "include_path" not in plain.cells()[0].identity() and len(calls) == 1


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
    ("- attention: full", "- attention: full\n    batch_size: 0",
     ["models[0].batch_size", "expected a positive integer, 'auto' or 'auto:N'", "got 0"]),
    ("- attention: full", "- attention: full\n    batch_size: auto:0", ["models[0].batch_size"]),
    ("- attention: full", "- attention: full\n    pretrained: [a, b]",
     ["models[0].pretrained", "expected a checkpoint path or short name", "['a', 'b']"]),
    ("- attention: full", "- attention: full\n    pretrained: {a: 1}", ["models[0].pretrained"]),
    ("- attention: full", "- attention: full\n    params: {page_size: 16}",
     ["models[0].params", "full takes no method parameters"]),
    ("- attention: full", "- attention: [full, quest]\n    params: {page_size: 16}",
     ["models[0].params", "full takes no method parameters", "an entry of its own"]),
    ("- attention: full", "- attention: nsa\n    params: {num_select: 4}",
     ["models[0].params", "attention=nsa takes only num_selected", "got num_select"]),
    ("- attention: full", "- attention: nsa\n    params: {num_selected: 0}",
     ["models[0].params", "num_selected: expected a positive integer", "got 0"]),
    ("niah_lengths: [1024, 2048]", "niah_lengths: [1024, 2048], niah_lenghts: [1024]",
     ["tasks[0].metadata.niah_lenghts", "unknown metadata key 'niah_lenghts'",
      "did you mean 'niah_lengths'", "niah_depths"]),
    ("niah_lengths: [1024, 2048]", "niah_lengths: [1024, abc]",
     ["tasks[0].metadata.niah_lengths", "expected a positive integer or a list", "'abc'"]),
    ("niah_depths: [0, 100]", "niah_depths: [0, 150]", ["tasks[0].metadata.niah_depths", "0 to 100"]),
    ("niah_depths: [0, 100]", "niah_depths: [0, 100], niah_template: {questoin: x}",
     ["tasks[0].metadata.niah_template", "answer_prefix"]),
    ("niah_lengths: [1024, 2048]", "niah_lengths: [1024, 1024]",
     ["tasks[0].metadata.niah_lengths", "1024 appears twice"]),
    ("{task: nsa_mmlu, models: [full]}", "{task: nsa_mmlu, metadata: {shots: 3}}",
     ["tasks[1].metadata.shots", "nsa_mmlu reads no metadata keys"]),
    ("{task: nsa_mmlu, models: [full]}", "{task: mmlu, split: parts, metadata: {parts: [a, a]}}",
     ["tasks[1].metadata.parts", "'a' appears twice"]),
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


SHARED = """\
name: t
defaults: {pretrained: smollm2-135m, sink: 64, local: 256}
models:
  - {label: tiny-b1, attention: full, batch_size: 1}
  - {label: tiny-b4, attention: full, batch_size: 4}
tasks:
  - {task: nsa_niah, label: niah, metadata: {niah_lengths: [1024], niah_depths: [50]}}
"""


def test_two_models_that_would_fill_the_same_cells_are_refused_naming_both(tmp_path):
    """Placement is not hashed, so entries that differ only there would share every cell, and the
    report one row (the last label's)."""
    path = write(tmp_path, SHARED)
    with pytest.raises(UsageError) as err:
        load_suite(path)
    assert str(err.value) == (
        f"{path}: models: 'tiny-b1' and 'tiny-b4' are the same model (pretrained smollm2-135m, attention "
        "full, dtype auto, truncation middle, backend hf); they differ only in batch_size (1 and 4), which "
        "a cell's key leaves out as it does not change the numbers, so both would be computed into the "
        "same cells and the report would show one row, 'tiny-b4'. Expected one entry for them, or entries "
        "that differ in a setting that changes the numbers")
    # full attention has no sink: an entry that differs only there is the same model too
    with pytest.raises(UsageError, match=r"differ only in sink \(64 and 32\)"):
        load_suite(write(tmp_path, SHARED.replace("batch_size: 4}", "batch_size: 1, sink: 32}"), "sink.yaml"))
    with pytest.raises(UsageError, match="differ only in their labels"):
        load_suite(write(tmp_path, SHARED.replace("batch_size: 4}", "batch_size: 1}"), "same.yaml"))
    # one folder spelled two ways is one checkpoint
    two_ways = SHARED.replace("{label: tiny-b1, attention: full", "{label: tiny-b1, attention: full, "
                              "pretrained: runs/ckpt").replace("{label: tiny-b4, attention: full",
                                                               "{label: tiny-b4, attention: full, "
                                                               "pretrained: ./runs/ckpt/")
    with pytest.raises(UsageError, match=r"'tiny-b1' and 'tiny-b4' are the same model \(pretrained "
                                         r"runs/ckpt, .*differ only in batch_size"):
        load_suite(write(tmp_path, two_ways, "two_ways.yaml"))
    # a setting that changes the numbers keeps both, each in its own cells and row
    suite = load_suite(write(tmp_path, SHARED.replace("batch_size: 4}", "batch_size: 4, dtype: bfloat16}"),
                             "dtype.yaml"))
    cells = suite.cells()
    assert [c.label for c in cells] == ["tiny-b1/niah", "tiny-b4/niah"] and cells[0].key != cells[1].key


def test_two_task_entries_that_would_fill_the_same_cell_are_refused(tmp_path):
    one_model = SHARED.replace("  - {label: tiny-b4, attention: full, batch_size: 4}\n", "")
    twice = one_model + "  - {task: nsa_niah, label: niah-again, metric: score, " \
                        "metadata: {niah_lengths: [1024], niah_depths: [50]}}\n"
    path = write(tmp_path, twice)
    with pytest.raises(UsageError) as err:
        load_suite(path)
    assert str(err.value).startswith(
        f"{path}: tasks: 'niah' and 'niah-again' give model 'tiny-b1' the same cell (task nsa_niah with the "
        "same settings: tiny-b1/niah and tiny-b1/niah-again); they differ only in metric (None and 'score')")
    # a split cell is the unsplit one-length entry's cell
    split = one_model + "  - {task: nsa_niah, label: grid, split: niah_lengths, " \
                        "metadata: {niah_lengths: [512, 1024], niah_depths: [50]}}\n"
    with pytest.raises(UsageError, match=r"tiny-b1/niah and tiny-b1/grid@1024\); they differ only in "
                                         r"metadata .*, split \(None and 'niah_lengths'\)"):
        load_suite(write(tmp_path, split, "split.yaml"))
    # entries that differ only in their limits are two cells, until --limit gives both the same one
    limits = one_model.replace("label: niah,", "label: niah, limit: 5,") + (
        "  - {task: nsa_niah, label: niah10, limit: 10,\n"
        "     metadata: {niah_lengths: [1024], niah_depths: [50]}}\n")
    suite = load_suite(write(tmp_path, limits, "limits.yaml"))
    assert len({c.key for c in suite.cells()}) == 2
    with pytest.raises(UsageError, match=r"differ only in limit \(5 and 10\) \(--limit 2 replaces both"):
        suite.cells(limit=2)


def test_other_tasks_metadata_passes_through(tmp_path):
    text = BASE.replace("{task: nsa_mmlu, models: [full]}",
                        "{task: ruler, metadata: {max_seq_lengths: [4096]}}")
    assert load_suite(write(tmp_path, text)).tasks[1].metadata == {"max_seq_lengths": [4096]}


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(UsageError, match="no such suite file"):
        load_suite(tmp_path / "absent.yaml")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_suite(write(tmp_path, "name: [unclosed"))
    with pytest.raises(UsageError, match="missing key 'tasks'"):
        parse_suite({"name": "x", "models": [{"pretrained": "a", "attention": "full"}]}, "mem")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(BASE.replace("name: t", "name: t\ndescription: caf\xe9").encode("latin-1"))
    with pytest.raises(UsageError, match="not a UTF-8 text file"):
        load_suite(latin1)


DUPLICATE_CASES = [
    # (replace this, with this, line of the second occurrence, key)
    ("    budget: [640, 1024]", "    budget: [640, 1024]\n    budget: 2048", 7, "budget"),
    ("  - {task: nsa_mmlu, models: [full]}",
     "  - {task: nsa_mmlu, models: [full]}\ndefaults: {dtype: float32}", 12, "defaults"),
    ("local: 256}", "local: 256, sink: 32}", 2, "sink"),
    ("{niah_lengths: [1024, 2048],", "{niah_lengths: [1024, 2048], niah_lengths: [1024],", 10,
     "niah_lengths"),
]


@pytest.mark.parametrize("old,new,line,key", DUPLICATE_CASES)
def test_a_key_given_twice_is_an_error(tmp_path, old, new, line, key):
    """safe_load would keep the last one silently."""
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(UsageError) as err:
        load_suite(path)
    assert str(err.value) == (f"{path}:{line}: duplicate key {key!r} (the second would silently "
                              "replace the first); keep one")


def test_a_key_overriding_a_merged_one_is_not_a_duplicate(tmp_path):
    text = BASE.replace("defaults: {", "defaults: &d {").replace(
        "  - attention: [topk, quest]", "  - <<: *d\n    sink: 32\n    attention: [topk, quest]")
    suite = load_suite(write(tmp_path, text))
    assert [m.sink for m in suite.models] == [64, 32, 32, 32, 32]


def test_limit_must_be_positive(tmp_path):
    suite = load_suite(write(tmp_path, BASE))
    for bad in (0, -3):
        with pytest.raises(UsageError, match="--limit: expected a positive integer"):
            suite.cells(limit=bad)


FULL_TINY_NAME = "full-tiny"
NAME_CASES = [
    ("attention: [topk, quest]", "attention: [topk, qeust]",
     ["attention", "unknown attention method 'qeust'"]),
    ("pretrained: smollm2-135m", "pretrained: /no/such/dir",
     ["pretrained", "/no/such/dir", "does not exist"]),
    ("    budget: [640, 1024]", "    budget: [640, 1024]\n    params: {page_sise: 8}",
     ["params", "unknown parameter(s) 'page_sise'"]),
    ("- attention: full", "- attention: full\n    device: gpu7",
     ["models (entry 'full').device", "'gpu7' is not a device", "expected cpu, cuda, cuda:N or mps"]),
    ("- attention: full", "- attention: full\n    device: meta", ["device", "unsupported device type"]),
    ("pretrained: smollm2-135m", f"pretrained: {FULL_TINY_NAME}, dense_layers: 99",
     ["dense_layers", "99 exceeds the", "layers of full-tiny"]),
    ("pretrained: smollm2-135m", "pretrained: smollm2-135m, dense_layers: 31",
     ["dense_layers", "31 exceeds the 30 layers of smollm2-135m"]),
    ("- attention: full", "- {label: full, attention: full}\n"
     "  - {label: n2, pretrained: nsa-tiny, attention: nsa, params: {num_selected: 2}}",
     ["models (entry 'n2').params: nsa-tiny: num_selected 2 is below the 3 blocks every query of this "
      "checkpoint selects (num_init 1 + num_local 2); expected num_selected >= 3"]),
    ("  - {task: nsa_mmlu, models: [full]}", "  - {task: nsa_mmlu, gen_kwargs: {max_gen_tokz: 3}}",
     ["tasks[1].gen_kwargs.max_gen_tokz", "unknown generation setting 'max_gen_tokz'",
      "did you mean 'max_gen_toks'"]),
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


def checkpoint_folder(root: Path, config: dict) -> Path:
    """A checkpoint folder of config.json alone, with the Python files its auto_map names beside it:
    importing one raises SystemExit, so a check that ran them would stop the test."""
    import json

    folder = root / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for module in ("configuration_mine.py", "modeling_mine.py"):
        (folder / module).write_text("raise SystemExit('remote code ran')\n")
    return folder


AUTO_MAP = {"AutoConfig": "configuration_mine.MyConfig", "AutoModelForCausalLM": "modeling_mine.MyModel"}
REMOTE = ("; its auto_map names remote code (configuration_mine.MyConfig, modeling_mine.MyModel), which "
          "nsa-eval does not run (no trust_remote_code)")


def causal_lm_expected() -> str:
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return (f"; expected a model_type transformers {__version__} loads as a causal LM without remote code "
            f"({len(MODEL_FOR_CAUSAL_LM_MAPPING)} of them: llama, mistral, qwen2, gpt2, ...), nsa_eval or "
            "fla's nsa")


@pytest.mark.parametrize("config, problem", [
    ({"model_type": "my_custom_lm", "auto_map": AUTO_MAP}, "transformers @V@ has no model_type 'my_custom_lm'"
     + REMOTE),
    ({"auto_map": AUTO_MAP}, "no model_type, which transformers @V@ needs to know what model it is" + REMOTE),
    ({}, "no model_type, which transformers @V@ needs to know what model it is, so the checkpoint "
         "cannot load"),
    ({"model_type": "t5", "auto_map": {"AutoModelForCausalLM": "modeling_mine.MyModel"}},
     "transformers @V@ has no causal LM (AutoModelForCausalLM) for model_type 't5'; its auto_map names "
     "remote code (modeling_mine.MyModel), which nsa-eval does not run (no trust_remote_code)"),
    ({"model_type": "t5"},
     "transformers @V@ has no causal LM (AutoModelForCausalLM) for model_type 't5', so the checkpoint "
     "cannot load"),
], ids=["unknown model_type, auto_map", "no model_type, auto_map", "no model_type", "t5, auto_map", "t5"])
def test_a_checkpoint_transformers_cannot_load_as_a_causal_lm_without_remote_code_is_refused(
        tmp_path, config, problem):
    """Each of these loads at `run` only by running the auto_map's code (which transformers would
    offer on a prompt) or not at all; validate refuses it from config.json, naming the folder."""
    from transformers import __version__

    folder = checkpoint_folder(tmp_path, config)
    path = write(tmp_path, BASE.replace("pretrained: smollm2-135m", f"pretrained: {folder}"))
    with pytest.raises(UsageError) as err:
        check_suite(load_suite(path), check_tasks=False, check_data=False)
    assert str(err.value) == (f"{path}: models (entry 'full').pretrained: {folder}/config.json: "
                              + problem.replace("@V@", __version__) + causal_lm_expected())


def test_a_known_causal_lm_with_an_auto_map_passes_and_vllm_is_not_held_to_automodel(tmp_path):
    """transformers loads a llama config with its own class and leaves the auto_map's code alone; a
    vllm entry is not refused for a model_type AutoModelForCausalLM lacks (vllm has its own classes)."""
    import importlib.util

    folder = checkpoint_folder(tmp_path, {"model_type": "llama", "auto_map": AUTO_MAP})
    path = write(tmp_path, BASE.replace("pretrained: smollm2-135m", f"pretrained: {folder}"))
    check_suite(load_suite(path), check_tasks=False, check_data=False)
    checkpoint_folder(tmp_path, {"model_type": "t5"})
    vllm = write(tmp_path, f"""\
        name: t
        models: [{{pretrained: {folder}, attention: full, backend: vllm}}]
        tasks: [nsa_niah]
        """, "vllm.yaml")
    if importlib.util.find_spec("vllm") is not None:
        check_suite(load_suite(vllm), check_tasks=False, check_data=False)
    else:
        with pytest.raises(UsageError, match=r"models \(entry 'full'\).backend: vllm is not installed"):
            check_suite(load_suite(vllm), check_tasks=False, check_data=False)


def test_nsa_selection_budget_sweeps_through_params(tmp_path):
    """num_selected overrides the checkpoint's at load: one model variant (and cell key) per value; an
    entry without it keeps the keys it had before the key existed."""
    text = textwrap.dedent("""\
        name: sweep
        defaults: {pretrained: nsa-tiny, attention: nsa}
        models:
          - {label: nsa}
          - {label: nsa@n4, params: {num_selected: 4}}
          - {label: nsa@n3, params: {num_selected: 3}}
        tasks:
          - {task: nsa_niah, metadata: {niah_lengths: [512], niah_depths: [50]}}
        """)
    suite = load_suite(write(tmp_path, text))
    plain, n4, n3 = suite.models
    assert "params" not in plain.identity() and "num_selected" not in plain.model_args()
    assert n4.identity()["params"] == {"num_selected": 4} and n4.model_args()["num_selected"] == 4
    assert len({c.key for c in suite.cells()}) == 3
    check_suite(suite, check_tasks=False, check_data=False)  # 3 = num_init 1 + num_local 2: allowed


def test_a_sliding_window_config_is_refused_for_the_baselines_before_loading(tmp_path):
    """apply_attention's own check (methods.check_model_config), run by validate on config.json."""
    model = tmp_path / "mistral"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mistral", "sliding_window": 64}')
    path = write(tmp_path, BASE.replace("pretrained: smollm2-135m", f"pretrained: {model}"))
    with pytest.raises(UsageError) as err:
        check_suite(load_suite(path), check_tasks=False, check_data=False)
    assert str(err.value).startswith(f"{path}: models (entry 'topk@640').attention: mistral config has an "
                                     "active sliding attention window (sliding_window=64)")
    (model / "config.json").write_text('{"model_type": "mistral", "sliding_window": null}')
    check_suite(load_suite(path), check_tasks=False, check_data=False)  # full attention: runs


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


def test_known_generation_settings_pass(tmp_path):
    text = BASE.replace("{task: nsa_mmlu, models: [full]}",
                        "{task: nsa_mmlu, gen_kwargs: {max_gen_toks: 8, until: [x], top_p: 0.9, "
                        "do_sample: true}}")
    check_suite(load_suite(write(tmp_path, text)), check_tasks=False, check_data=False)


def test_a_device_this_machine_lacks_fails_a_run_and_warns_validate(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    suite = load_suite(write(tmp_path, BASE.replace("sink: 64,", "sink: 64, device: cuda,")))
    with pytest.raises(UsageError, match=r"models \(entry 'full' and 4 more\)\.device: 'cuda': no CUDA GPU"):
        check_suite(suite, check_tasks=False, check_data=False)  # runs_here (run) by default
    warnings = check_suite(suite, check_tasks=False, check_data=False, runs_here=False)
    assert len(warnings) == 1 and "no CUDA GPU" in warnings[0]
    cpu = load_suite(write(tmp_path, BASE, "cpu.yaml"))
    with pytest.raises(UsageError, match="--device: 'cuda:1': no CUDA GPU"):
        check_suite(cpu, check_tasks=False, check_data=False, device="cuda:1")
    with pytest.raises(UsageError, match="--device: 'gpu7' is not a device"):
        check_suite(cpu, check_tasks=False, check_data=False, device="gpu7", runs_here=False)
    assert check_suite(cpu, check_tasks=False, check_data=False, device="cpu") == []


def test_metric_and_placement_are_not_hashed_but_vllm_engine_arguments_are(tmp_path):
    keys = lambda text, name: [c.key for c in load_suite(write(tmp_path, text, name)).cells()]  # noqa: E731
    base = keys(BASE, "a.yaml")
    with_metric = BASE.replace("models: [full]}", "models: [full], metric: f1}")
    assert keys(with_metric, "metric.yaml") == base
    vllm = BASE.replace("- attention: full", "- attention: full\n    backend: vllm\n    vllm: VLLM")
    plain = keys(vllm.replace("VLLM", "{}"), "v0.yaml")
    placed = keys(vllm.replace("VLLM", "{tensor_parallel_size: 4, gpu_memory_utilization: 0.5, "
                                       "data_parallel_size: 2}"), "v1.yaml")
    assert placed == plain
    quantized = keys(vllm.replace("VLLM", "{quantization: fp8}"), "v2.yaml")
    longer = keys(vllm.replace("VLLM", "{max_model_len: 4096}"), "v3.yaml")
    full_cells = 3  # full x (niah@1024, niah@2048, mmlu)
    assert all(a != b for a, b in zip(plain[:full_cells], quantized[:full_cells], strict=True))
    assert all(a != b for a, b in zip(plain[:full_cells], longer[:full_cells], strict=True))
    assert quantized[full_cells:] == plain[full_cells:]  # the hf models are untouched


def test_sink_window_ignores_the_budget(tmp_path):
    text = BASE.replace("attention: [topk, quest]", "attention: [sink_window, topk]")
    suite = load_suite(write(tmp_path, text))
    assert [m.label for m in suite.models] == ["full", "sink_window@320", "topk@640", "topk@1024"]
    window = suite.models[1]
    assert window.budget == 64 + 256 and "budget" not in window.identity()
    other = load_suite(write(tmp_path, text.replace("budget: [640, 1024]", "budget: [2048]"), "b.yaml"))
    assert other.models[1].label == "sink_window@320"
    assert [c.key for c in other.cells() if c.model.attention == "sink_window"] == [
        c.key for c in suite.cells() if c.model.attention == "sink_window"]


def test_lm_factory_seeds_vllm_with_the_suite_seed(tmp_path, monkeypatch):
    from nsa_eval import runner

    text = BASE.replace("name: t", "name: t\nseed: 7")
    text = text.replace("- attention: full", "- attention: full\n    backend: vllm")
    suite = load_suite(write(tmp_path, text))
    seen = []
    monkeypatch.setattr(runner, "build_vllm_lm", lambda model, seed=1234: seen.append(seed))
    runner.LMFactory(seed=suite.seed)(suite.models[0])
    assert seen == [7]

    calls = []
    monkeypatch.setattr(runner, "LMFactory", lambda seed=1234: calls.append(seed) or (lambda m: None))
    monkeypatch.setattr(runner, "evaluate_cell", lambda lm, cell, run_dir: None)
    runner.run_suite(suite, tmp_path / "run", progress=False, only="full/*")
    assert calls == [7]


def readme_suite_example() -> str:
    """The first yaml block of README.md's Suites section."""
    readme = (CONFIGS.parent / "README.md").read_text()
    section = readme.split("## Suites", 1)[1].split("\n## ", 1)[0]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_readme_suite_example_validates(tmp_path):
    from nsa_eval.models.loading import CHECKPOINTS_DIR

    text = readme_suite_example()
    assert "pretrained: /ckpt/my-nsa" in text
    path = write(tmp_path, text.replace("/ckpt/my-nsa", str(CHECKPOINTS_DIR / "nsa-tiny")), "readme.yaml")
    suite = load_suite(path)
    labels = [m.label for m in suite.models]
    assert labels[:2] == ["full", "nsa"] and "smollm2-135m:topk@640" in labels and len(labels) == 14
    check_suite(suite, check_data=False, runs_here=False)  # the task index too; device: cuda warns
    assert {c.model.label for c in suite.cells() if c.task.label == "gsm8k"} == {"full", "nsa"}


def test_shipped_configs_parse():
    for name in ("quickstart", "paper", "budget_sweep"):
        suite = load_suite(CONFIGS / f"{name}.yaml")
        assert suite.name == name and suite.cells()
    sweep = load_suite(CONFIGS / "budget_sweep.yaml")
    assert {m.budget for m in sweep.models if m.attention == "quest"} == {640, 1280, 2560, 5120}
    assert [m.label for m in sweep.models if m.attention == "sink_window"] == ["sink_window@640"]

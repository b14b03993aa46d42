"""Malformed and hostile suites, as a careless or hostile user would write them: `nsa-eval validate`
refuses each with one line naming the file and what is wrong, exit code 2, no traceback and no hang,
before any model loads; nothing is written outside the folders nsa-eval made.

Each case used to give a traceback, a hang, memory without end, an error only once the model had
loaded, or writes where the user keeps their own files."""

from __future__ import annotations

import os
import signal
import textwrap
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import __version__ as transformers_version

from nsa_eval.cli import main

GOOD = """\
name: hostile
output: @ROOT@/run
report: @ROOT@/report
defaults: {pretrained: full-tiny, dtype: float32, sink: 16, local: 32, budget: 64}
models:
  - attention: [full, topk]
tasks:
  - task: nsa_niah
    metadata: {niah_lengths: [128], niah_depths: [50]}
    gen_kwargs: {max_gen_toks: 4}
"""


def laughs(levels: int = 9) -> str:
    """The YAML "billion laughs": ten aliases of ten aliases ... of ten strings, 10^levels in all."""
    anchors = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    anchors += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(anchors) + "]"


def nested(levels: int = 5000) -> str:
    return "[" * levels + "]" * levels


def replace(old: str, new: str) -> Callable[[Path, str], str]:
    def edit(root: Path, text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)

    return edit


def with_files(files: Callable[[Path], None], old: str = "", new: str = "") -> Callable[[Path, str], str]:
    def edit(root: Path, text: str) -> str:
        files(root)
        return text.replace(old, new, 1) if old else text

    return edit


def include_path(make: Callable[[Path], None]) -> Callable[[Path, str], str]:
    """The suite with `include_path: tasks`, a folder `make` fills."""
    def fill(root: Path) -> None:
        (root / "tasks").mkdir()
        make(root / "tasks")

    return with_files(fill, "name: hostile\n", "name: hostile\ninclude_path: tasks\n")


def task_yaml(name: str, extra: str = "") -> str:
    return textwrap.dedent(f"""\
        task: {name}
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: data.jsonl}}}}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{q}}}}"
        doc_to_target: a
        metric_list: [{{metric: exact_match}}]
        """) + extra


def user_folder(root: Path) -> None:
    """A folder of the user's, with files nsa-eval must neither delete nor overwrite."""
    (root / "mine").mkdir()
    (root / "mine" / "holiday.png").write_bytes(b"\x89PNG not a report")
    (root / "mine" / "report.md").write_text("my notes")


def haystack(texts: dict[str, str]) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / "hay").mkdir()
        for name, text in texts.items():
            (root / "hay" / name).write_text(text)

    return make


def checkpoint_config(text: str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / "ckpt").mkdir()
        (root / "ckpt" / "config.json").write_text(text)

    return make


def remote_code_checkpoint(root: Path, model_type_key: str = '"model_type": "my_custom_lm", ') -> None:
    """A model transformers does not know, whose config.json points at code beside it (which must not run);
    `model_type_key` is its config.json's model_type as JSON, empty for none."""
    checkpoint_config('{' + model_type_key + '"max_position_embeddings": 4096, "auto_map": '
                      '{"AutoConfig": "configuration_mine.MyConfig", '
                      '"AutoModelForCausalLM": "modeling_mine.MyModel"}}')(root)
    for module in ("configuration_mine.py", "modeling_mine.py"):
        (root / "ckpt" / module).write_text("raise SystemExit('remote code ran')\n")


LAUGHS = laughs()
HAY = "niah_depths: [50]}"
CASES = {
    # YAML that expands or nests without end
    "billion laughs in description": (
        replace("name: hostile\n", f"name: hostile\ndescription: {LAUGHS}\n"),
        "its aliases (*name) expand to more than 10,000 values"),
    "billion laughs in params": (
        replace("[full, topk]", f"[topk]\n    params: {{x: {LAUGHS}}}"),
        "expand to more than 10,000 values"),
    "billion laughs in metadata": (
        replace(HAY, f"niah_depths: [50], tokenizer: {LAUGHS}}}"),
        "expand to more than 10,000 values"),
    "billion laughs in gen_kwargs.until": (
        replace("max_gen_toks: 4}", f"max_gen_toks: 4, until: {LAUGHS}}}"),
        "expand to more than 10,000 values"),
    "5,000 levels of nesting": (
        replace("name: hostile\n", f"name: hostile\ndescription: {nested()}\n"),
        "nested deeper than 32 levels"),
    "a recursive alias": (
        replace("name: hostile\n", "name: hostile\ndescription: &loop [*loop]\n"),
        "an alias refers to a node that contains it"),
    # values that used to fail only in `run`, most after the model had loaded
    "a seed numpy cannot take": (
        replace("name: hostile\n", "name: hostile\nseed: 1000000000000000000000000000000\n"),
        "seed: 1000000000000000000000000000000 is out of range; expected an integer from 0 to 4,294,967,295"),
    "a negative seed": (
        replace("name: hostile\n", "name: hostile\nseed: -1\n"),
        "seed: -1 is out of range"),
    "a budget past int32": (
        replace("budget: 64}", "budget: 1000000000000000000000000000000}"),
        "defaults.budget: 1000000000000000000000000000000 is out of range"),
    "a budget list past int32": (
        replace("[full, topk]", "[topk]\n    budget: [64, 99999999999999]"),
        "models[0].budget: 99999999999999 is out of range"),
    "max_gen_toks -1": (
        replace("max_gen_toks: 4", "max_gen_toks: -1"),
        "tasks[0].gen_kwargs.max_gen_toks: expected a positive integer (new tokens), got -1"),
    "a temperature below 0": (
        replace("max_gen_toks: 4", "max_gen_toks: 4, temperature: -1"),
        "gen_kwargs.temperature: expected a number >= 0"),
    "until that is not text": (
        replace("max_gen_toks: 4", "max_gen_toks: 4, until: [1, 2]"),
        "gen_kwargs.until: expected a string or a list of strings"),
    "a niah_template with an unknown field": (
        replace(HAY, "niah_depths: [50], niah_template: {needle: 'The {kee} is {value}.'}}"),
        "metadata.niah_template.needle: unknown placeholder {kee}; expected {key} and {value}"),
    "a niah_template with a lone brace": (
        replace(HAY, "niah_depths: [50], niah_template: {question: 'What is {key'}}"),
        "metadata.niah_template.question: expected '}' before end of string"),
    "a niah_template needle without the value": (
        replace(HAY, "niah_depths: [50], niah_template: {needle: 'The {key} is hidden.'}}"),
        "metadata.niah_template.needle: no {value} placeholder"),
    "a haystack folder that does not exist": (
        replace(HAY, "niah_depths: [50], niah_haystack: /no/such/hay}"),
        "tasks[0].metadata.niah_haystack: '/no/such/hay' is not a folder"),
    "an empty haystack folder": (
        with_files(haystack({}), HAY, "niah_depths: [50], niah_haystack: @ROOT@/hay}"),
        "has no .txt files"),
    "a haystack of empty files": (
        with_files(haystack({"a.txt": "", "b.txt": "  \n"}), HAY,
                   "niah_depths: [50], niah_haystack: @ROOT@/hay}"),
        "the .txt files of"),
    "a config.json that is a list": (
        with_files(checkpoint_config("[1, 2]"), "pretrained: full-tiny", "pretrained: @ROOT@/ckpt"),
        "config.json: expected a JSON object of model settings, got a list"),
    "a checkpoint of remote code (auto_map)": (
        with_files(remote_code_checkpoint, "pretrained: full-tiny", "pretrained: @ROOT@/ckpt"),
        "ckpt/config.json: transformers @VERSION@ has no model_type 'my_custom_lm'; its auto_map names "
        "remote code (configuration_mine.MyConfig, modeling_mine.MyModel), which nsa-eval does not run"),
    "a model_type transformers does not know": (
        with_files(checkpoint_config('{"model_type": "my_custom_lm"}'), "pretrained: full-tiny",
                   "pretrained: @ROOT@/ckpt"),
        "ckpt/config.json: transformers @VERSION@ has no model_type 'my_custom_lm', so the checkpoint "
        "cannot load"),
    "a checkpoint of remote code (auto_map) without model_type": (
        with_files(lambda root: remote_code_checkpoint(root, ""), "pretrained: full-tiny",
                   "pretrained: @ROOT@/ckpt"),
        "ckpt/config.json: no model_type, which transformers @VERSION@ needs to know what model it is; its "
        "auto_map names remote code (configuration_mine.MyConfig, modeling_mine.MyModel), which nsa-eval "
        "does not run"),
    "a config.json without model_type": (
        with_files(checkpoint_config('{"max_position_embeddings": 4096}'), "pretrained: full-tiny",
                   "pretrained: @ROOT@/ckpt"),
        "ckpt/config.json: no model_type, which transformers @VERSION@ needs to know what model it is, so "
        "the checkpoint cannot load"),
    "a model_type with no causal LM": (
        with_files(checkpoint_config('{"model_type": "t5"}'), "pretrained: full-tiny",
                   "pretrained: @ROOT@/ckpt"),
        "ckpt/config.json: transformers @VERSION@ has no causal LM (AutoModelForCausalLM) for model_type "
        "'t5', so the checkpoint cannot load"),
    # folders nsa-eval must not write in
    "output: / (the filesystem root)": (
        replace("output: @ROOT@/run", "output: /"),
        "output: '/' is the filesystem root"),
    "report: / (the filesystem root)": (
        replace("report: @ROOT@/report", "report: /"),
        "report: '/' is the filesystem root"),
    "output: '' (the current directory)": (
        replace("output: @ROOT@/run", "output: ''"),
        "output: '' is the current directory itself"),
    "output: . (the current directory)": (
        replace("output: @ROOT@/run", "output: ."),
        "output: '.' is the current directory itself"),
    "report: ~ (the home folder)": (
        replace("report: @ROOT@/report", "report: '~'"),
        "report: '~' is your home folder"),
    "report: a folder of the user's": (
        with_files(user_folder, "report: @ROOT@/report", "report: @ROOT@/mine"),
        "already exists and was not made by nsa-eval (no .nsa-eval file in it)"),
    "output: a folder of the user's": (
        with_files(user_folder, "output: @ROOT@/run", "output: @ROOT@/mine"),
        "already exists and was not made by nsa-eval"),
    "output under /proc": (
        replace("output: @ROOT@/run", "output: /proc/nsa-eval-run"),
        "cannot create '/proc/nsa-eval-run': /proc does not take new folders"),
    "output and report the same folder": (
        replace("report: @ROOT@/report", "report: @ROOT@/run"),
        "is also"),
    # include_path: files lm-eval would open, and tasks it would replace
    "a FIFO named *.yaml under include_path": (
        include_path(lambda d: os.mkfifo(d / "blocks.yaml")),
        "blocks.yaml: not a regular file"),
    "a *.yaml link to /dev/zero under include_path": (
        include_path(lambda d: (d / "endless.yaml").symlink_to("/dev/zero")),
        "endless.yaml: not a regular file"),
    "a task YAML of billion laughs": (
        include_path(lambda d: (d / "t.yaml").write_text(f"task: t\nx: {LAUGHS}\n")),
        "t.yaml: line 2: its aliases (*name) expand to more than 200,000 values"),
    "a task YAML that includes a FIFO": (
        include_path(lambda d: os.mkfifo(d / "base.yml") or (d / "t.yaml").write_text("include: base.yml\n")),
        "base.yml: not a regular file"),
    "an include_path task that shadows nsa_niah": (
        include_path(lambda d: (d / "n.yaml").write_text(task_yaml("nsa_niah"))),
        "defines 'nsa_niah', which"),
}


class Hang(Exception):
    pass


@pytest.fixture
def no_hang():
    """Turn a hang into a failure: the FIFO cases used to block forever."""
    def alarm(*_):
        raise Hang("validate hung")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def write_suite(root: Path, edit=None) -> Path:
    text = GOOD
    if edit is not None:
        text = edit(root, text)
    text = text.replace("@ROOT@", str(root))
    path = root / "suite.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_suite_is_refused_by_validate(case, tmp_path, capsys, monkeypatch, no_hang):
    monkeypatch.chdir(tmp_path)
    edit, message = CASES[case]
    message = message.replace("@VERSION@", transformers_version)
    path = write_suite(tmp_path, edit)
    before = sorted(p.name for p in tmp_path.iterdir())
    started = time.monotonic()
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nsa-eval: error: {path}") or err.startswith("nsa-eval: error: ")
    assert message in err, err
    assert len(err.splitlines()) == 1 and len(err) < 1000, err
    assert time.monotonic() - started < 60
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    if (tmp_path / "mine").is_dir():
        assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["holiday.png", "report.md"]


@pytest.mark.parametrize("case", ["report: a folder of the user's", "output: '' (the current directory)",
                                  "report: / (the filesystem root)", "billion laughs in params",
                                  "a checkpoint of remote code (auto_map)",
                                  "a checkpoint of remote code (auto_map) without model_type"])
def test_run_refuses_them_too_before_anything_is_written(case, tmp_path, capsys, monkeypatch, no_hang):
    monkeypatch.chdir(tmp_path)
    edit, message = CASES[case]
    message = message.replace("@VERSION@", transformers_version)
    path = write_suite(tmp_path, edit)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if (tmp_path / "mine").is_dir():
        assert (tmp_path / "mine" / "report.md").read_text() == "my notes"


def test_validate_never_offers_to_run_a_tokenizers_remote_code(tmp_path, capsys, monkeypatch):
    """The NIAH fit check loads the tokenizer; one whose tokenizer_config.json maps AutoTokenizer to
    code beside it would make transformers ask on stdin and run that code on a yes."""
    import json
    import shutil

    from nsa_eval.models.loading import CHECKPOINTS_DIR

    prompts: list = []
    monkeypatch.setattr("builtins.input", lambda prompt="": prompts.append(prompt) or "y")
    ckpt = shutil.copytree(CHECKPOINTS_DIR / "full-tiny", tmp_path / "ckpt")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        config | {"tokenizer_class": "MyTokenizer",
                  "auto_map": {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}}))
    (ckpt / "tokenization_mine.py").write_text("raise SystemExit('remote code ran')\n")
    # 134 tokens leave 2 beside a 128-token prompt and 4 new ones, so the tokenizer is measured
    path = write_suite(tmp_path, replace("pretrained: full-tiny", f"pretrained: {ckpt}, max_length: 134"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nsa-eval: error: {path}: tasks[0] (nsa_niah) on models (entry 'full'): cannot "
                          f"measure the NIAH prompt's framing with {ckpt}'s tokenizer (The repository "
                          f"{ckpt} contains custom code"), err
    assert len(err.splitlines()) == 1 and prompts == []


def test_a_suite_file_that_is_a_fifo_is_refused(tmp_path, capsys, no_hang):
    os.mkfifo(tmp_path / "suite.yaml")
    assert main(["validate", str(tmp_path / "suite.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (f"nsa-eval: error: {tmp_path / 'suite.yaml'}: cannot read the "
                                               "suite file (not a regular file)")


def test_a_suite_file_past_one_mib_is_refused(tmp_path, capsys):
    path = write_suite(tmp_path)
    path.write_text(path.read_text() + "#" * (1 << 20) + "\n")
    assert main(["validate", str(path)]) == 2
    assert "bytes; at most 1,048,576 expected" in capsys.readouterr().err


def test_unsafe_code_needs_both_opt_ins_before_any_model_loads(tmp_path, capsys, monkeypatch):
    suite = write_suite(tmp_path, replace("  - task: nsa_niah\n", "  - task: nsa_mbpp\n    label: mbpp\n"
                                          "  - task: nsa_niah\n"))
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    assert main(["validate", str(suite)]) == 2
    assert ("tasks[0].confirm_run_unsafe_code: nsa_mbpp executes model-written code to score it; expected "
            "confirm_run_unsafe_code: true") in capsys.readouterr().err
    confirmed = suite.read_text().replace("label: mbpp", "label: mbpp\n    confirm_run_unsafe_code: true")
    suite.write_text(confirmed)
    # the opt-in of the machine: `run` stops before any model loads; `validate` may check for another one
    assert main(["run", str(suite)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("needs the environment variable HF_ALLOW_CODE_EVAL=1 (it is None); set it where "
                        "nsa-eval runs") and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    from nsa_eval.suite import check_suite, load_suite

    assert check_suite(load_suite(suite), check_data=False, runs_here=True) == []


def test_an_include_path_task_with_function_is_named_by_validate(tmp_path, capsys):
    def make(folder: Path) -> None:
        (folder / "mine.yaml").write_text(task_yaml("my_task", "process_docs: !function helpers.clean\n"))
        (folder / "helpers.py").write_text("def clean(docs):\n    return docs\n")
        (folder / "data.jsonl").write_text('{"q": "1 + 1", "a": "2"}\n')

    path = write_suite(tmp_path, include_path(make))
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {path}: include_path: {tmp_path / 'tasks' / 'mine.yaml'} runs Python code when its "
            "task is built (!function helpers.clean); run only task folders you trust") in err


def test_a_large_file_under_include_path_is_hashed_without_reading_it_whole(tmp_path):
    from nsa_eval.suite import include_path_fingerprint

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "big.bin").write_bytes(os.urandom(1 << 20) * 64)  # 64 MiB
    tracemalloc.start()
    include_path_fingerprint((str(tmp_path / "tasks"),))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20, f"{peak:,} bytes held at once"

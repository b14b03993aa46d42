"""Multi-key and multi-hop NIAH: exact lengths and depths, seeding, answers that need the right needle
(every other needle carries another value), metadata checks, and a run through lm-eval."""

from __future__ import annotations

import re
import textwrap

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.tasks.needles import count_tokens, needle_token_index
from nsa_eval.tasks.niah import needle_found
from nsa_eval.tasks.niah_multi import (
    LINK,
    MULTIHOP,
    MULTIKEY,
    VALUE,
    make_multihop_doc,
    make_multikey_doc,
    multihop_dataset,
    multikey_dataset,
)

MAKERS = {"multikey": make_multikey_doc, "multihop": make_multihop_doc}


def _check_layout(tokenizer, doc, template) -> None:
    """Length, and every needle at start_i + round(depth_i / 100 * H), measured here independently:
    start_i from the prompt written out with an empty haystack, positions from the needles' text."""
    prompt, length = doc["input"] + " " + doc["gen_prefix"], doc["context_length"]
    assert count_tokens(tokenizer, prompt) == length
    texts = [n["text"] for n in doc["needles"]]
    question = template.question.format(key=doc["key"])
    empty = f"{template.instruction}\n{' '.join(texts)}\n{question} {doc['gen_prefix']}"
    budget = length - count_tokens(tokenizer, empty)
    assert doc["haystack_tokens"] == budget
    depths = [n["depth_percent"] for n in doc["needles"]]
    assert depths == sorted(depths)
    for needle in doc["needles"]:
        start = needle_token_index(tokenizer, empty, empty.index(needle["text"]))
        found = needle_token_index(tokenizer, prompt, prompt.index(needle["text"]))
        assert needle["position"] == found == start + round(needle["depth_percent"] / 100 * budget)


@pytest.mark.parametrize("tokenizer_name", ["bpe_tokenizer", "unigram_tokenizer", "nsa_tiny_tokenizer"])
def test_multikey_prompts_are_exact_and_need_the_asked_key(tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    for length in (400, 1024):
        for depth in (0.0, 33.33, 100.0):
            doc = make_multikey_doc(tokenizer, length, depth, seed=2, num_needles=5)
            _check_layout(tokenizer, doc, MULTIKEY)
            prompt = doc["input"]
            keys = [re.search(r"numbers for (\w+) is", n["text"]).group(1) for n in doc["needles"]]
            values = [n["text"][-8:-1] for n in doc["needles"]]
            assert len(set(keys)) == len(set(values)) == 5  # distinct keys, distinct values
            asked = keys.index(doc["key"])
            assert values[asked] == doc["answer"] and doc["needles"][asked]["depth_percent"] == depth
            assert doc["needles"][asked]["position"] == doc["needle_position"]
            # the builtin haystack has no digits: the needles' values are the prompt's only numbers
            assert sorted(re.findall(r"\d+", prompt)) == sorted(values)
            assert prompt.endswith(MULTIKEY.question.format(key=doc["key"]))


@pytest.mark.parametrize("tokenizer_name", ["bpe_tokenizer", "unigram_tokenizer", "nsa_tiny_tokenizer"])
def test_multihop_prompts_are_exact_and_need_both_needles_of_the_chain(tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    for length in (400, 1024):
        for depth in (0.0, 55.56, 100.0):
            doc = make_multihop_doc(tokenizer, length, depth, seed=5, num_chains=3)
            _check_layout(tokenizer, doc, MULTIHOP)
            prompt, key, name, value = doc["input"], doc["key"], doc["name"], doc["answer"]
            texts = [n["text"] for n in doc["needles"]]
            link, answer = LINK.format(key=key, name=name), VALUE.format(name=name, value=value)
            assert link in texts and answer in texts and len(texts) == 6
            assert texts.index(link) < texts.index(answer)  # the chain reads forward
            value_needle = doc["needles"][texts.index(answer)]
            assert doc["link_position"] < doc["needle_position"] == value_needle["position"]
            assert doc["link_depth_percent"] <= depth == doc["depth_percent"]
            # among the needles the key is only in its link, and the name (its own word) only in that
            # link and the value needle; the other chains carry other values
            assert [t for t in texts if f" {key} " in t] == [link]
            assert [t for t in texts if f" {name} " in t or f" {name}." in t] == [link, answer]
            values = re.findall(r"\d+", prompt)
            assert len(values) == len(set(values)) == 3 and values.count(value) == 1
            for other in texts:
                if other.startswith("The number stored") and other != answer:
                    assert value not in other and f" {name} " not in other


def test_depth_extremes_put_the_asked_needle_first_and_last(bpe_tokenizer):
    first = make_multikey_doc(bpe_tokenizer, 600, 0, seed=1)
    assert first["input"].startswith(MULTIKEY.instruction + "\n" + MULTIKEY.needle.format(
        key=first["key"], value=first["answer"]))
    last = make_multihop_doc(bpe_tokenizer, 600, 100, seed=1)
    question = MULTIHOP.question.format(key=last["key"])
    assert last["input"].endswith(VALUE.format(name=last["name"], value=last["answer"]) + "\n" + question)


@pytest.mark.parametrize("kind", ["multikey", "multihop"])
def test_same_seed_same_prompt_other_seed_other_prompt(kind, bpe_tokenizer):
    make = MAKERS[kind]
    a = make(bpe_tokenizer, 500, 40, seed=7)
    assert a == make(bpe_tokenizer, 500, 40, seed=7)
    b = make(bpe_tokenizer, 500, 40, seed=8)
    assert a["prompt"] != b["prompt"] and a["answer"] != b["answer"]
    assert len(a["answer"]) == 7 and a["answer"].isdigit()
    assert len(a["needles"]) == (4 if kind == "multikey" else 8)  # the default counts


def test_bad_counts_and_depths_are_usage_errors(bpe_tokenizer):
    with pytest.raises(UsageError, match="niah_needles must be an integer from 2 to 32; got 1"):
        make_multikey_doc(bpe_tokenizer, 500, 50, seed=0, num_needles=1)
    with pytest.raises(UsageError, match="niah_chains must be an integer from 1 to 16; got 17"):
        make_multihop_doc(bpe_tokenizer, 500, 50, seed=0, num_chains=17)
    with pytest.raises(UsageError, match="depth_percent must be in"):
        make_multihop_doc(bpe_tokenizer, 500, 101, seed=0)
    with pytest.raises(UsageError, match="shorter than the template"):
        make_multikey_doc(bpe_tokenizer, 60, 50, seed=0, num_needles=8)


@pytest.mark.parametrize("build, count_key",
                         [(multikey_dataset, "niah_needles"), (multihop_dataset, "niah_chains")])
def test_the_dataset_is_the_grid_of_the_metadata(build, count_key, bpe_tokenizer, tmp_path):
    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    data = build(tokenizer=str(tmp_path / "tok"), niah_lengths="[600, 700]", niah_depths=[0, 100],
                 niah_samples_per_cell=2, niah_seed=5, **{count_key: "2"}, version=1.0)["test"]
    assert len(data) == 2 * 2 * 2
    assert sorted({(r["context_length"], r["depth_percent"]) for r in data}) == [
        (600, 0.0), (600, 100.0), (700, 0.0), (700, 100.0)]
    assert {r["seed"] for r in data} == {5000, 5001}
    assert "prompt" not in data.column_names
    with pytest.raises(UsageError, match="builds its prompts with the model's tokenizer"):
        build(niah_lengths=[200])


SUITE = """\
name: multi
models: [{label: tiny, pretrained: nsa-tiny, attention: nsa}]
tasks:
  - task: TASK
    metadata: METADATA
"""
BAD_METADATA = [
    ("nsa_niah_multikey", "{niah_lengths: [512], niah_needles: 1}",
     "metadata.niah_needles: expected an integer from 2 to 32 (needles, the asked one included), got 1"),
    ("nsa_niah_multihop", "{niah_lengths: [512], niah_chains: 17}",
     "metadata.niah_chains: expected an integer from 1 to 16"),
    ("nsa_niah_multihop", "{niah_lengths: [512], niah_needles: 3}",
     "metadata.niah_needles: nsa_niah_multihop: unknown metadata key 'niah_needles'"),
    ("nsa_niah_multikey", "{niah_lengths: [512], niah_template: {needle: 'x {value}'}}",
     "unknown metadata key 'niah_template'"),
    ("nsa_niah_multikey", "{niah_depths: [0, 101]}", "metadata.niah_depths: expected a number from 0 to 100"),
]


@pytest.mark.parametrize("task, metadata, message", BAD_METADATA)
def test_a_suite_checks_their_metadata_when_it_loads(task, metadata, message, tmp_path):
    from nsa_eval.suite import load_suite

    path = tmp_path / "multi.yaml"
    path.write_text(SUITE.replace("TASK", task).replace("METADATA", metadata))
    with pytest.raises(UsageError) as err:
        load_suite(path)
    assert str(err.value).startswith(f"{path}: tasks[0].metadata.") and message in str(err.value)


def test_a_grid_past_the_models_context_is_refused(tmp_path):
    """As for nsa_niah: lm-eval would cut the prompt, perhaps without its needles."""
    from nsa_eval.suite import check_suite, load_suite

    path = tmp_path / "multi.yaml"
    path.write_text(SUITE.replace("TASK", "nsa_niah_multihop").replace("METADATA", "{niah_lengths: [8192]}"))
    with pytest.raises(UsageError, match=r"tasks\[0\] \(nsa_niah_multihop\) on models \(entry 'tiny'\): a "
                                         "8192-token NIAH prompt and max_gen_toks 32 need 8224 tokens"):
        check_suite(load_suite(path), check_data=False)
    path.write_text(SUITE.replace("TASK", "nsa_niah_multikey").replace("METADATA", "{niah_lengths: [8160]}"))
    check_suite(load_suite(path), check_data=False)


def test_through_lm_eval_on_a_tiny_model(tiny_lm):
    """simple_evaluate on a random tiny Llama: each sample carries its grid cell for the heatmap, the
    model sees exactly the built prompt, and the score is the niah one."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from nsa_eval.tasks import task_manager

    tok_dir, model = tiny_lm
    manager = task_manager({"tokenizer": str(tok_dir), "niah_lengths": [600], "niah_depths": [0, 100],
                            "niah_needles": 3, "niah_chains": 2}, all_lm_eval_tasks=False)
    lm = HFLM(pretrained=model, tokenizer=str(tok_dir), device="cpu", batch_size=1, max_length=1024)
    out = lm_eval.simple_evaluate(model=lm, tasks=["nsa_niah_multikey", "nsa_niah_multihop"],
                                  task_manager=manager, log_samples=True, bootstrap_iters=0,
                                  gen_kwargs={"max_gen_toks": 3})
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    for task, needles in (("nsa_niah_multikey", 3), ("nsa_niah_multihop", 4)):
        assert 0.0 <= out["results"][task]["score,none"] <= 1.0
        cells = set()
        for sample in out["samples"][task]:
            doc = sample["doc"]
            cells.add((doc["context_length"], doc["depth_percent"]))
            context = sample["arguments"][0][0]
            assert context == doc["input"] + " " + doc["gen_prefix"]
            assert len(tokenizer(context, add_special_tokens=False)["input_ids"]) == 600
            assert len(doc["needles"]) == needles and sample["metrics"] == ["score"]
            assert sample["score"] == float(needle_found(sample["filtered_resps"][0], doc["answer"]))
        assert cells == {(600, 0.0), (600, 100.0)}


def test_the_report_draws_their_heatmaps(tmp_path):
    """A run of both tasks on a tiny random Llama: niah.csv and one heatmap per task, as for nsa_niah."""
    import csv

    from nsa_eval.report import write_report
    from nsa_eval.runner import run_suite
    from nsa_eval.suite import load_suite
    from tests.suite_fixtures import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model")
    suite = tmp_path / "suite.yaml"
    suite.write_text(textwrap.dedent(f"""\
        name: multi
        defaults: {{pretrained: {model}, dtype: float32}}
        models: [{{label: full, attention: full}}]
        tasks:
          - task: nsa_niah_multikey
            label: multikey
            split: niah_lengths
            metadata: {{niah_lengths: [256, 320], niah_depths: [0, 100], niah_needles: 2}}
            gen_kwargs: {{max_gen_toks: 2}}
          - task: nsa_niah_multihop
            label: multihop
            metadata: {{niah_lengths: [288], niah_depths: [50], niah_chains: 1}}
            gen_kwargs: {{max_gen_toks: 2}}
        """))
    run_suite(load_suite(suite), tmp_path / "run", progress=False)
    out = write_report(tmp_path / "run", tmp_path / "report")
    rows = list(csv.DictReader((out / "niah.csv").open()))
    assert sorted((r["task"], int(r["context_length"]), float(r["depth_percent"])) for r in rows) == [
        ("multihop", 288, 50.0), ("multikey", 256, 0.0), ("multikey", 256, 100.0),
        ("multikey", 320, 0.0), ("multikey", 320, 100.0)]
    assert sorted(p.name for p in (out / "figures").glob("niah_*.png")) == [
        "niah_multihop_full.png", "niah_multikey_full.png"]

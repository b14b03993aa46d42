"""NIAH prompts: exact token length and needle depth for several tokenizers, seeding, haystacks, scoring."""

from __future__ import annotations

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.tasks import niah
from nsa_eval.tasks.haystack import builtin_haystack
from nsa_eval.tasks.niah import (
    DEFAULT_TEMPLATE,
    NiahTemplate,
    count_tokens,
    grid_docs,
    make_niah_doc,
    needle_token_index,
    process_results,
)

LENGTHS = [320, 900, 2500]
DEPTHS = [0.0, 11.11, 50.0, 100.0]


def _needle_first_token(tokenizer, doc) -> int:
    """Token index of the needle, found independently: where the needle text starts in the prompt."""
    needle = DEFAULT_TEMPLATE.needle.format(key=doc["key"], value=doc["answer"])
    return needle_token_index(tokenizer, doc["prompt"], doc["prompt"].index(needle))


def _check_grid(tokenizer):
    empty = make_niah_doc(tokenizer, LENGTHS[0], 0.0, seed=3)
    start = empty["needle_position"]  # with depth 0 the needle opens the haystack
    for n in LENGTHS:
        for d in DEPTHS:
            doc = make_niah_doc(tokenizer, n, d, seed=3)
            assert count_tokens(tokenizer, doc["prompt"]) == n, (n, d)
            assert len(tokenizer(doc["prompt"], add_special_tokens=False)["input_ids"]) == n
            budget = doc["haystack_tokens"]
            assert 0 < budget < n
            expected = start + round(d / 100 * budget)
            assert doc["needle_position"] == expected == _needle_first_token(tokenizer, doc), (n, d)
            assert doc["prompt"] == doc["input"] + " " + doc["gen_prefix"]
            assert doc["prompt"].endswith(DEFAULT_TEMPLATE.answer_prefix.format(key=doc["key"]))
            assert (doc["context_length"], doc["depth_percent"]) == (n, d)


def test_exact_length_and_depth_byte_level_bpe(bpe_tokenizer):
    _check_grid(bpe_tokenizer)


def test_exact_length_and_depth_unigram_metaspace(unigram_tokenizer):
    _check_grid(unigram_tokenizer)


def test_exact_length_and_depth_smollm2(smollm2_tokenizer):
    _check_grid(smollm2_tokenizer)


SWEEP_LENGTHS = [256, 512, 1024, 1536, 2048]


def _check_sweep(tokenizer, lengths, seeds):
    """Every (length, depth, seed) cell of the paper's depths builds, exact in length and depth."""
    for n in lengths:
        for seed in seeds:
            start = make_niah_doc(tokenizer, n, 0.0, seed)["needle_position"]  # depth 0: needle first
            for d in niah.PAPER_DEPTHS:
                doc = make_niah_doc(tokenizer, n, d, seed)
                assert count_tokens(tokenizer, doc["prompt"]) == n, (n, d, seed)
                expected = start + round(d / 100 * doc["haystack_tokens"])
                assert doc["needle_position"] == expected == _needle_first_token(tokenizer, doc), (n, d, seed)


def test_every_cell_builds_exactly_nsa_tiny(nsa_tiny_tokenizer):
    # 150 cells; with one haystack start per cell, 5 of them (e.g. 1536 x 33.33 % x seed 0) fail
    _check_sweep(nsa_tiny_tokenizer, SWEEP_LENGTHS, seeds=range(3))


@pytest.mark.parametrize("name", ["bpe_tokenizer", "unigram_tokenizer", "smollm2_tokenizer"])
def test_every_cell_builds_exactly_test_tokenizers(name, request):
    _check_sweep(request.getfixturevalue(name), SWEEP_LENGTHS, seeds=[1])


def test_cell_without_exact_cut_uses_a_later_haystack_start(nsa_tiny_tokenizer, monkeypatch):
    tok = nsa_tiny_tokenizer
    doc = make_niah_doc(tok, 1536, 33.33, seed=0)
    assert doc == make_niah_doc(tok, 1536, 33.33, seed=0)  # the fallback is deterministic too
    haystack = doc["prompt"][len(DEFAULT_TEMPLATE.instruction) + 1 :]
    assert haystack[0].isupper()  # it starts at a later sentence, not mid-word
    # with only the text's own start the same cell cannot be exact: a clear error, no approximation
    monkeypatch.setattr(niah, "MAX_HAYSTACK_STARTS", 1)
    with pytest.raises(RuntimeError, match=r"exactly 1536 tokens.*tried 1 haystack starts"):
        make_niah_doc(tok, 1536, 33.33, seed=0)


def test_depth_extremes_place_needle_first_and_last(bpe_tokenizer):
    first = make_niah_doc(bpe_tokenizer, 500, 0, seed=1)
    last = make_niah_doc(bpe_tokenizer, 500, 100, seed=1)
    needle = DEFAULT_TEMPLATE.needle.format(key=first["key"], value=first["answer"])
    assert first["prompt"].startswith(DEFAULT_TEMPLATE.instruction + "\n" + needle)
    needle = DEFAULT_TEMPLATE.needle.format(key=last["key"], value=last["answer"])
    question = DEFAULT_TEMPLATE.question.format(key=last["key"])
    assert last["prompt"].split("\n" + question)[0].endswith(needle)


def test_same_seed_same_prompt_other_seed_other_prompt(bpe_tokenizer):
    a = make_niah_doc(bpe_tokenizer, 400, 40, seed=7)
    b = make_niah_doc(bpe_tokenizer, 400, 40, seed=7)
    c = make_niah_doc(bpe_tokenizer, 400, 40, seed=8)
    assert a == b
    assert a["prompt"] != c["prompt"]
    assert len(a["answer"]) == 7 and a["answer"].isdigit()
    assert grid_docs(bpe_tokenizer, [300], [0, 50], seed=2, progress=False) == grid_docs(
        bpe_tokenizer, [300], [0, 50], seed=2, progress=False
    )


def test_builtin_haystack_is_varied_and_digit_free():
    import random

    text = builtin_haystack(20_000, random.Random(0))
    sentences = [s for s in text.replace("\n", " ").split(". ") if s]
    assert len(set(sentences)) > 0.9 * len(sentences)  # not one repeated sentence
    assert not any(ch.isdigit() for ch in text)


def test_folder_haystack(tmp_path, bpe_tokenizer):
    (tmp_path / "b.txt").write_text("Second essay about gardens and rivers. " * 5)
    (tmp_path / "a.txt").write_text("First essay about startups and towns. " * 5)
    doc = make_niah_doc(bpe_tokenizer, 600, 50, seed=0, haystack=str(tmp_path))
    assert count_tokens(bpe_tokenizer, doc["prompt"]) == 600  # the short folder is repeated
    assert "First essay" in doc["prompt"] and "Second essay" in doc["prompt"]
    assert doc["prompt"].index("First essay") < doc["prompt"].index("Second essay")  # name order
    with pytest.raises(UsageError, match="'builtin' or a folder"):
        make_niah_doc(bpe_tokenizer, 600, 50, seed=0, haystack=str(tmp_path / "no_such_dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .txt files"):
        make_niah_doc(bpe_tokenizer, 600, 50, seed=0, haystack=str(tmp_path / "empty"))


def test_custom_template(bpe_tokenizer):
    template = NiahTemplate(
        instruction="Find the pass key.",
        needle="The pass key for {key} is {value}.",
        question="What is the pass key for {key}?",
        answer_prefix="The pass key for {key} is",
    )
    doc = make_niah_doc(bpe_tokenizer, 300, 25, seed=0, template=template)
    assert f"The pass key for {doc['key']} is {doc['answer']}." in doc["prompt"]
    assert count_tokens(bpe_tokenizer, doc["prompt"]) == 300


def test_too_short_length_is_a_usage_error(bpe_tokenizer):
    with pytest.raises(UsageError, match="shorter than the template"):
        make_niah_doc(bpe_tokenizer, 10, 50, seed=0)
    with pytest.raises(UsageError, match="depth_percent"):
        make_niah_doc(bpe_tokenizer, 300, 101, seed=0)


@pytest.mark.parametrize(
    "answer, score",
    [
        (" 4821937.", 1.0),
        ("The special magic number is 4821937", 1.0),
        ("4821937\nsomething else", 1.0),
        (" 48219370.", 0.0),  # a longer number is not the needle
        (" 14821937", 0.0),
        (" 4821936.", 0.0),
        (" 4,821,937", 0.0),  # exact match of the value, as written in the needle
        ("", 0.0),
    ],
)
def test_scoring_on_hand_made_answers(answer, score):
    assert process_results({"answer": "4821937"}, [answer]) == {"score": score}


def test_niah_dataset_reads_metadata(bpe_tokenizer, tmp_path):
    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    data = niah.niah_dataset(
        tokenizer=str(tmp_path / "tok"),
        niah_lengths="[300, 400]",
        niah_depths=[0, 100],
        niah_samples_per_cell=2,
        niah_seed=5,
        version=1.0,
    )["test"]
    assert len(data) == 2 * 2 * 2
    assert sorted({(r["context_length"], r["depth_percent"]) for r in data}) == [
        (300, 0.0),
        (300, 100.0),
        (400, 0.0),
        (400, 100.0),
    ]
    assert "prompt" not in data.column_names  # input + gen_prefix hold it
    with pytest.raises(UsageError, match="tokenizer"):
        niah.niah_dataset(niah_lengths=[200])


@pytest.mark.parametrize(
    "template",
    [
        DEFAULT_TEMPLATE,
        NiahTemplate(question="What is the special magic number for {key}?\n"),  # ends with whitespace
        NiahTemplate(answer_prefix=""),  # no gen_prefix at all
        NiahTemplate(answer_prefix=" The number is"),  # starts with whitespace
    ],
    ids=["default", "question-ends-with-newline", "empty-answer-prefix", "prefix-starts-with-space"],
)
def test_lm_eval_assembles_exactly_the_built_prompt(template, bpe_tokenizer, tmp_path):
    """lm-eval's own request building (nsa_niah through the TaskManager) gives the built prompt."""
    from dataclasses import asdict

    from nsa_eval.tasks import task_manager

    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    metadata = {
        "tokenizer": str(tmp_path / "tok"),
        "niah_lengths": [300],
        "niah_depths": [50],
        "niah_template": asdict(template),
    }
    (task,) = task_manager(metadata, all_lm_eval_tasks=False).load(["nsa_niah"])["tasks"].values()
    task.build_all_requests(rank=0, world_size=1)
    (instance,) = task.instances
    context = instance.arguments[0]
    built = make_niah_doc(bpe_tokenizer, 300, 50.0, seed=0, template=template)
    assert context == built["prompt"]
    assert count_tokens(bpe_tokenizer, context) == 300
    assert built["prompt"].endswith(template.answer_prefix.format(key=built["key"]))
    if not template.answer_prefix:
        assert built["gen_prefix"] == "" and built["input"] == built["prompt"]

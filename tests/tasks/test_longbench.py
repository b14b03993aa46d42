"""LongBench: every metric on hand-computed examples, prompts, middle truncation."""

from __future__ import annotations

import pytest

from nsa_eval.tasks import longbench as lb


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        # normalized: "cat sat on mat" vs "cat on mat": overlap 3, P=3/4, R=1 -> F1 = 6/7
        ("The cat sat on the mat", "a cat on a mat", 6 / 7),
        ("Paris.", "paris", 1.0),
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
    ],
)
def test_qa_f1(prediction, reference, expected):
    assert lb.qa_f1(prediction, reference) == pytest.approx(expected)


def test_qa_f1_zh():
    # jieba: 猫 / ， / 狗 ; punctuation dropped -> [猫, 狗] vs [猫]: P=1/2, R=1 -> 2/3
    assert lb.qa_f1_zh("猫，狗", "猫") == pytest.approx(2 / 3)
    assert lb.qa_f1_zh("北京。", "北京") == pytest.approx(1.0)
    assert lb.qa_f1_zh("猫", "狗") == 0.0


def test_rouge_l():
    # LCS("the cat sat", "the cat was here") = "the cat": P=2/3, R=2/4 -> F = 2PR/(P+R) = 4/7
    assert lb.rouge_l("the cat sat", "the cat was here") == pytest.approx(4 / 7, abs=1e-6)
    assert lb.rouge_l("a b c", "a b c") == pytest.approx(1.0, abs=1e-6)
    assert lb.rouge_l("", "anything") == 0.0  # unscorable -> 0, as the official scorer


def test_rouge_l_zh():
    # jieba words "猫 ， 狗" vs "猫": LCS 1, P=1/3, R=1 -> F = 1/2
    assert lb.rouge_l_zh("猫，狗", "猫") == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize(
    "prediction, expected",
    [("Paragraph 12", 1.0), ("Paragraph 3 or Paragraph 12", 0.5), ("Paragraph 1", 0.0), ("no idea", 0.0)],
)
def test_retrieval(prediction, expected):
    assert lb.retrieval(prediction, "Paragraph 12") == expected


@pytest.mark.parametrize("prediction, expected", [("段落5", 1.0), ("段落5和段落7", 0.5), ("段落6", 0.0)])
def test_retrieval_zh(prediction, expected):
    assert lb.retrieval_zh(prediction, "段落5") == expected


def test_code_sim():
    # the first line without `, # or // is compared: identical -> 1
    assert lb.code_sim("\n# a comment\nx = 1\ny = 2", "x = 1") == 1.0
    # fuzz.ratio("abcd", "abce") = round(100 * 2 * 3 / 8) = 75
    assert lb.code_sim("abcd", "abce") == 0.75
    assert lb.code_sim("// only comments", "x = 1") == 0.0


def _indel_percent(a: str, b: str) -> int:
    """python-Levenshtein's ratio, written out: 2 * LCS / (len(a) + len(b)), as fuzzywuzzy rounds it."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return int(round(100 * 2 * previous[-1] / (len(a) + len(b))))


@pytest.mark.parametrize(
    "prediction, reference, percent",
    [
        # LCS("tide", "diet") = 2 ("ie"): 2 * 2 / 8 = 50 (difflib's fallback gives 25)
        ("tide", "diet", 50),
        # a call with its arguments swapped: LCS 40 of 52 + 52 characters = 77 (difflib: 56)
        (
            "result = compute(beta, alpha) + compute(alpha, beta)",
            "result = compute(alpha, beta) + compute(beta, alpha)",
            77,
        ),
        # attributes assigned in the other order (difflib: 56)
        ("    self.height, self.width = width, height", "    self.width, self.height = height, width", 67),
    ],
)
def test_code_sim_is_the_levenshtein_backed_ratio(prediction, reference, percent):
    """The official scorer on python-Levenshtein, not fuzzywuzzy's difflib fallback (pinned in
    pyproject.toml), whatever else happens to be installed."""
    assert _indel_percent(prediction, reference) == percent
    assert lb.code_sim(prediction, reference) == percent / 100


def test_code_sim_refuses_the_difflib_fallback(monkeypatch):
    import difflib

    from fuzzywuzzy import fuzz

    from nsa_eval.errors import UsageError

    monkeypatch.setattr(fuzz, "SequenceMatcher", difflib.SequenceMatcher)  # as without python-Levenshtein
    with pytest.raises(UsageError, match="python-Levenshtein"):
        lb.code_sim("tide", "diet")


def test_score_takes_the_best_reference_and_names_the_metric():
    doc = {"answers": ["London", "the city of Paris"]}
    out = lb.score("hotpotqa", "Paris", doc)
    # vs "city of paris" (normalized): overlap 1, P=1, R=1/3 -> 1/2
    assert out == {"score": pytest.approx(0.5), "qa_f1": pytest.approx(0.5)}
    assert lb.process_results_passage_retrieval_en({"answers": ["Paragraph 4"]}, ["Paragraph 4"]) == {
        "score": 1.0,
        "retrieval": 1.0,
    }
    assert set(lb.process_results_lcc({"answers": ["x = 1"]}, ["x = 1"])) == {"score", "code_sim"}


def test_every_subset_has_prompt_length_and_metric():
    assert len(lb.SUBSETS) == 10
    for subset, (prompt, max_new, metric) in lb.SUBSETS.items():
        assert "{context}" in prompt and metric in lb.METRICS and max_new in (32, 64, 128, 512)
        assert callable(getattr(lb, f"doc_to_text_{subset}"))
    # official strings, where lm-eval's copies differ
    assert lb.SUBSETS["passage_retrieval_en"][0].endswith("The answer is: ")
    assert lb.SUBSETS["lcc"][0].endswith("Next line of code:\n")


def test_prompt_from_either_schema():
    thudm = {"input": "Who?", "context": "Ann wrote it.", "answers": ["Ann"]}
    text = lb.doc_to_text_hotpotqa(thudm)
    assert text.startswith("Answer the question based on the given passages.")
    assert "\nAnn wrote it.\n" in text and text.endswith("Question: Who?\nAnswer:")
    mirror = {"context": "CTX ", "question": "Q? ", "answer_prefix": "Answer:", "answer": ["Ann"]}
    assert lb.doc_to_text_hotpotqa(mirror) == "CTX Q? Answer:"
    assert lb.answers(mirror) == ["Ann"] and lb.doc_to_target(thudm) == "Ann"


def test_truncate_middle_keeps_head_and_tail():
    ids = list(range(10))
    assert lb.truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert lb.truncate_middle(ids, 5) == [0, 1, 7, 8, 9]
    assert lb.truncate_middle(ids, 10) == ids and lb.truncate_middle(ids, 50) == ids
    with pytest.raises(ValueError):
        lb.truncate_middle(ids, 0)


def test_truncate_prompt_middle_keeps_instruction_and_question(bpe_tokenizer):
    head, tail = "Read the passages.\n", "\nQuestion: who wrote it?\nAnswer:"
    prompt = head + "the old farmer carried a wooden chair. " * 200 + tail
    cut = lb.truncate_prompt_middle(bpe_tokenizer, prompt, 60)
    assert cut.startswith(head) and cut.endswith(tail)
    assert len(bpe_tokenizer(cut, add_special_tokens=False)["input_ids"]) <= 62
    assert lb.truncate_prompt_middle(bpe_tokenizer, "short", 60) == "short"


def _with_bos(tokenizer):
    """A copy of a fast tokenizer that adds its BOS token to every encoding, as Llama's does."""
    import copy

    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    bos = tokenizer.bos_token
    special = [(bos, tokenizer.bos_token_id)]
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=special)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=tokenizer.eos_token)


def test_truncate_prompt_middle_counts_and_keeps_as_pred_py_does(bpe_tokenizer):
    """pred.py counts the tokens the model reads (its BOS too) and keeps int(n / 2) at each end."""
    tokenizer = _with_bos(bpe_tokenizer)
    words = "the old farmer carried a wooden chair. " * 40
    ids = tokenizer(words)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    n = len(ids) - 1  # the text alone fits n tokens; with the BOS it does not
    cut = lb.truncate_prompt_middle(tokenizer, words, n)
    half = n // 2
    expected = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )
    assert cut == expected and cut != words
    assert lb.truncate_prompt_middle(tokenizer, words, n + 1) == words  # the BOS and the text fit
    odd = lb.truncate_prompt_middle(bpe_tokenizer, words, 31)
    assert len(bpe_tokenizer(odd)["input_ids"]) <= 30 + 2  # 2 x 15 kept, re-encoded within a token or two


def _long_rows(n: int = 2) -> list[dict]:
    return [
        {
            "input": f"Who wrote book {i}?",
            "context": "Passage 1:\n" + "the old farmer carried a wooden chair. " * 300,
            "answers": ["Ann Lee"],
            "length": 3000,
            "dataset": "hotpotqa",
            "language": "en",
            "all_classes": None,
            "_id": f"long-{i}",
        }
        for i in range(n)
    ]


def test_a_task_level_length_cuts_longbench_prompts_in_the_middle(tiny_lm, data_root, rows):
    """metadata longbench_max_length: the prompt LongBench's pred.py would give a model of that limit,
    whatever the model's own context (read with the model's tokenizer, the runner's `pretrained`)."""
    from transformers import AutoTokenizer

    from nsa_eval.tasks import task_manager
    from nsa_eval.tasks.longbench_task import LongBenchTask

    tok_dir, _ = tiny_lm
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    rows.write(data_root, "Xnhyacinth/LongBench", "hotpotqa", "test", _long_rows())
    whole = task_manager({}, all_lm_eval_tasks=False).load(["nsa_longbench_hotpotqa"])["tasks"]
    (whole,) = whole.values()
    manager = task_manager({"pretrained": str(tok_dir), "longbench_max_length": 200}, all_lm_eval_tasks=False)
    (task,) = manager.load(["nsa_longbench_hotpotqa"])["tasks"].values()
    assert isinstance(task, LongBenchTask) and task.max_prompt_tokens == 200
    for doc in task.test_docs():
        full = whole.fewshot_context(doc=doc, num_fewshot=0)
        cut = task.fewshot_context(doc=doc, num_fewshot=0)
        assert len(tokenizer(full)["input_ids"]) > 2000  # emitted whole without the key
        assert cut == lb.truncate_prompt_middle(tokenizer, full, 200)
        assert len(tokenizer(cut)["input_ids"]) <= 202
        assert cut.startswith("Answer the question based on the given passages.")
        assert cut.endswith(f"Question: {doc['input']}\nAnswer:")


def test_the_length_needs_a_tokenizer_and_a_positive_integer(data_root, rows):
    from nsa_eval.errors import UsageError
    from nsa_eval.tasks import task_manager

    rows.write(data_root, "Xnhyacinth/LongBench", "hotpotqa", "test", _long_rows())
    with pytest.raises(UsageError, match="longbench_max_length counts the model's tokens"):
        task_manager({"longbench_max_length": 100}, all_lm_eval_tasks=False).load(["nsa_longbench_hotpotqa"])
    with pytest.raises(UsageError, match="must be a positive integer"):
        task_manager({"longbench_max_length": "31.5k", "tokenizer": "x"}, all_lm_eval_tasks=False).load(
            ["nsa_longbench_hotpotqa"]
        )

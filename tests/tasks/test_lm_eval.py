"""The project's YAMLs through lm-eval: the index knows them, they build, and three run end to end."""

from __future__ import annotations

import pytest

from nsa_eval.tasks import PROJECT_TASKS, TASKS_DIR
from nsa_eval.tasks.data import data_specs
from nsa_eval.tasks.general import GENERAL_TASKS


def test_index_has_every_project_task(manager):
    assert str(TASKS_DIR).endswith("nsa_eval/tasks")
    missing = [name for name in PROJECT_TASKS if name not in manager.all_tasks]
    assert missing == []
    assert set(GENERAL_TASKS) <= set(PROJECT_TASKS)


def test_general_groups_pin_shots_and_read_local_data(manager, data_root, rows):
    rows.write(data_root, "openai/gsm8k", "main", "test", [{"question": "2+2?", "answer": "2+2=4\n#### 4"}])
    loaded = manager.load(["nsa_gsm8k"])
    (task,) = loaded["tasks"].values()
    assert type(task).__name__ == "LocalFirstTask"
    assert task.config.num_fewshot == 8 and len(task.test_docs()) == 1
    # a nested group (bbh_fewshot inside nsa_bbh_direct) gets the overrides too
    for subject in [spec.name for spec in data_specs(["nsa_bbh_direct"], manager)["nsa_bbh_direct"]]:
        rows.write(
            data_root, "SaylorTwift/bbh", subject, "test", [{"input": "True and False is", "target": "False"}]
        )
    tasks = manager.load(["nsa_bbh_direct"])["tasks"]
    assert len(tasks) == 27
    assert {(type(t).__name__, t.config.num_fewshot) for t in tasks.values()} == {("LocalFirstTask", 3)}


def _general_rows(path: str, n: int = 6) -> list[dict]:
    """Made-up rows in MMLU-Pro's, CMMLU's or MATH's schema."""
    if path == "TIGER-Lab/MMLU-Pro":
        categories = ["biology", "business", "chemistry", "computer science", "economics", "engineering",
                      "health", "history", "law", "math", "other", "philosophy", "physics", "psychology"]
        return [{"question_id": i, "question": f"Q{i}?", "options": ["a", "b", "c", "d"], "answer": "A",
                 "answer_index": 0, "cot_content": "A: Let's think step by step. The answer is (A).",
                 "category": c, "src": "fixture"} for i, c in enumerate(categories * n)]
    if path == "haonan-li/cmmlu":
        return [{"Question": f"问题{i}", "A": "a", "B": "b", "C": "c", "D": "d", "Answer": "A"}
                for i in range(n)]
    return [{"problem": f"What is {i} + 1?", "level": "Level 1", "type": "Algebra",
             "solution": f"It is $\\boxed{{{i + 1}}}$."} for i in range(n)]


@pytest.mark.parametrize(
    "name, leaves, shots, asked",
    [("nsa_mmlu_pro", 14, 5, "Answer: Let's think step by step."), ("nsa_cmmlu", 67, 5, "答案："),
     ("nsa_math", 7, 4, "Solution:")],
)
def test_the_other_table_1_groups_pin_shots_and_read_local_data(name, leaves, shots, asked, manager,
                                                                data_root):
    """MMLU-Pro, CMMLU and MATH, which configs/paper.yaml ran as lm-eval's own tasks (hub only)."""
    from nsa_eval.tasks.local_data import write_jsonl

    for spec in data_specs([name], manager)[name]:
        for path in spec.files():
            write_jsonl(path, _general_rows(spec.path))
    tasks = manager.load([name])["tasks"]
    assert len(tasks) == leaves
    assert {(type(t).__name__, t.config.num_fewshot) for t in tasks.values()} == {("LocalFirstTask", shots)}
    task = next(iter(tasks.values()))
    context = task.fewshot_context(doc=task.test_docs()[0], num_fewshot=shots)
    assert context.count(asked) == shots + 1  # the examples, then the question


@pytest.fixture
def evaluated(tiny_lm, data_root, rows):
    """simple_evaluate on a random tiny Llama: NIAH (2 cells), LongBench hotpotqa, AIME 8k (2 docs each)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from nsa_eval.tasks import task_manager

    tok_dir, model = tiny_lm
    rows.write(data_root, "Xnhyacinth/LongBench", "hotpotqa", "test", rows.longbench(2))
    rows.write(data_root, "Maxwell-Jia/AIME_2024", None, "train", rows.aime(2))
    manager = task_manager(
        {"tokenizer": str(tok_dir), "niah_lengths": [300], "niah_depths": [0, 100]}, all_lm_eval_tasks=False
    )
    lm = HFLM(pretrained=model, tokenizer=str(tok_dir), device="cpu", batch_size=1, max_length=1024)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=["nsa_niah", "nsa_longbench_hotpotqa", "nsa_aime24_8k"],
        task_manager=manager,
        limit=2,
        log_samples=True,
        bootstrap_iters=0,
        gen_kwargs={"max_gen_toks": 3},
    )


def test_end_to_end_with_a_tiny_model(evaluated, tiny_lm):
    from transformers import AutoTokenizer

    results, samples = evaluated["results"], evaluated["samples"]
    assert 0.0 <= results["nsa_niah"]["score,none"] <= 1.0
    assert set(results["nsa_longbench_hotpotqa"]) >= {"score,none", "qa_f1,none"}
    aime = results["nsa_aime24_8k"]
    assert {"avg_at_k,all-samples", "pass_at_k,all-samples", "maj_at_k,all-samples"} <= set(aime)

    # NIAH: every sample carries its grid cell, and the model saw exactly the built prompt
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm[0])
    cells = set()
    for sample in samples["nsa_niah"]:
        doc = sample["doc"]
        cells.add((doc["context_length"], doc["depth_percent"]))
        context = sample["arguments"][0][0]
        assert context == doc["input"] + " " + doc["gen_prefix"]
        assert len(tokenizer(context, add_special_tokens=False)["input_ids"]) == doc["context_length"] == 300
        assert sample["metrics"] == ["score"]
    assert cells == {(300, 0.0), (300, 100.0)}

    # LongBench: the official prompt around the fixture row
    context = samples["nsa_longbench_hotpotqa"][0]["arguments"][0][0]
    assert context.startswith("Answer the question based on the given passages.") and context.endswith(
        "Answer:"
    )

    # AIME: k = 16 sampled responses per problem, all kept for the metrics
    sample = samples["nsa_aime24_8k"][0]
    assert len(sample["filtered_resps"][0]) == 16
    gen_kwargs = sample["arguments"][0][1]
    assert (
        gen_kwargs["do_sample"] is True and gen_kwargs["temperature"] == 0.7 and gen_kwargs["top_p"] == 0.95
    )


def test_longbench_group_is_the_unweighted_mean_of_subsets(manager, data_root, rows):
    from nsa_eval.tasks.longbench import SUBSETS

    for subset in SUBSETS:
        rows.write(data_root, "Xnhyacinth/LongBench", subset, "test", rows.longbench(1))
    loaded = manager.load(["nsa_longbench"])
    group = loaded["groups"]["nsa_longbench"]
    assert len(loaded["tasks"]) == 10
    # made-up subset scores with very different sizes: the paper's average ignores the sizes
    scores = {f"nsa_longbench_{s}": (i / 10, 1 + 100 * i) for i, s in enumerate(SUBSETS)}
    metrics = {
        task: {"score,none": value, "score_stderr,none": 0.0, "sample_len": n}
        for task, (value, n) in scores.items()
    }
    assert group.aggregate(metrics)["score,none"] == pytest.approx(sum(v for v, _ in scores.values()) / 10)

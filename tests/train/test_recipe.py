"""The training loop on the CPU with the tiny configuration, for both attentions."""

import json
from dataclasses import replace

import pytest
import torch

from nsa_eval.train.data import make_batch
from nsa_eval.train.recipe import (
    build_model,
    load_checkpoint,
    lr_at,
    save_checkpoint,
    tiny_config,
    train,
    weighted_loss,
)


@pytest.mark.parametrize("attention", ["nsa", "full"])
def test_loss_decreases_on_a_fixed_batch(tiny_corpus, attention):
    cfg = tiny_config(attention)
    torch.manual_seed(0)
    model = build_model(attention, cfg.model, tiny_corpus.tokenizer)
    ids, w = (torch.from_numpy(x) for x in make_batch(tiny_corpus, 0, 0, 2, 128, cfg.mix))  # [2, 129]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss, _ = weighted_loss(model(input_ids=ids[:, :-1], use_cache=False).logits, ids[:, 1:], w[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("attention", ["nsa", "full"])
def test_checkpoint_reloads_with_identical_logits(tiny_corpus, tmp_path, attention):
    cfg = tiny_config(attention)
    torch.manual_seed(1)
    model = build_model(attention, cfg.model, tiny_corpus.tokenizer)
    save_checkpoint(model, tiny_corpus.tokenizer, tmp_path)
    assert load_checkpoint(tmp_path)[0].dtype == torch.bfloat16  # stored in bf16
    loaded, tokenizer = load_checkpoint(tmp_path, dtype=torch.float32)
    with torch.no_grad():  # the checkpoint holds the weights rounded to bf16, nothing else changes
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.tensor([tokenizer("def f(x):\n    return x + 1\n" * 8)["input_ids"][:200]])  # [1, 200]
    with torch.no_grad():
        ref = model.eval()(input_ids=ids, use_cache=False).logits
        got = loaded.eval()(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert tokenizer.eos_token == tiny_corpus.tokenizer.eos_token


def test_train_writes_logs_checkpoint_and_is_seeded(tiny_corpus, tmp_path):
    cfg = tiny_config("full", steps=3)
    first = train(cfg, tiny_corpus, tmp_path / "a")
    second = train(cfg, tiny_corpus, tmp_path / "b")
    assert first["steps"] == 3 and first["tokens"] == 3 * cfg.batch_size * cfg.seq_len
    for name in ("log.jsonl", "log.csv", "evals.jsonl", "summary.json", "checkpoint/config.json",
                 "checkpoint/model.safetensors", "checkpoint/tokenizer.json", "checkpoint/training.json"):
        assert (tmp_path / "a" / name).exists(), name
    rows = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    rows_b = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [r["loss"] for r in rows_b]  # same seed, same run
    assert first["final_eval"]["heldout_loss"] == second["final_eval"]["heldout_loss"]


def test_nsa_trains_a_few_steps(tiny_corpus, tmp_path):
    summary = train(tiny_config("nsa", steps=2), tiny_corpus, tmp_path)
    model, _ = load_checkpoint(tmp_path / "checkpoint")
    assert type(model).__name__ == "NSAForCausalLM" and summary["steps"] == 2
    assert model.config.num_selected == 3 and model.config.window == 64
    assert torch.isfinite(torch.tensor(summary["final_eval"]["heldout_loss"]))
    assert 0 <= summary["final_eval"]["probe_needle_selected"] <= 1  # NSA's evaluations say it


def test_needle_selected_reads_the_blocks_of_the_value_at_the_first_answer_query():
    import numpy as np

    from nsa_eval.train.recipe import needle_selected

    # 0-9 filler, the value 5 6 7 at 10-12, filler to 19, then the answer " 5 6 7 ." EOS from 20
    ids = np.array([1] * 10 + [5, 6, 7] + [1] * 7 + [2, 5, 6, 7, 3, 0])
    weights = np.zeros(len(ids), dtype=np.float32)
    weights[20:] = 1.0
    blocks = torch.full((len(ids) - 1, 2, 2), -1)  # [T, Hkv, n], blocks of 4 tokens
    blocks[19, 0] = torch.tensor([2, 3])  # the value's tokens 10-12 lie in block 2 and 3
    blocks[19, 1] = torch.tensor([2, 4])
    assert needle_selected([blocks, blocks], ids, weights, select_size=4) == [True, False] * 2
    assert needle_selected([blocks], ids, weights, select_size=8) == [False, False]  # block 1 now
    weights[:] = 0
    weights[10:] = 1.0  # an "answer" with no earlier copy of its value: nothing to say
    assert needle_selected([blocks], ids, weights, select_size=4) == []


def test_wide_selection_trains_its_first_steps_on_more_blocks(tiny_corpus, tmp_path, monkeypatch):
    """`wide_selection=(4, 2)`: steps 0-1 select 4 blocks a query and steps 2-3 the model's 3; every
    evaluation (probes included) and the checkpoint use 3."""
    from nsa_eval.models import modeling_nsa

    plain, seen = modeling_nsa.nsa_attention, []

    def recording(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), kwargs["num_selected"]))
        return plain(*args, **kwargs)

    monkeypatch.setattr(modeling_nsa, "nsa_attention", recording)
    summary = train(tiny_config("nsa", steps=4, num_evals=2, wide_selection=(4, 2)), tiny_corpus, tmp_path)
    layers = 2
    training = [n for grad, n in seen if grad]
    assert training == [4] * (2 * layers) + [3] * (2 * layers)
    assert {n for grad, n in seen if not grad} == {3}  # the evaluations at steps 0, 2 and 4
    assert load_checkpoint(tmp_path / "checkpoint")[0].config.num_selected == 3
    assert summary["config"]["wide_selection"] == [4, 2]
    with pytest.raises(ValueError, match=r"wide_selection \(2, 2\): NSA runs only, with n >= the model's "
                                         r"num_selected \(3\)"):
        train(tiny_config("nsa", steps=1, wide_selection=(2, 2)), tiny_corpus, tmp_path / "narrow")
    with pytest.raises(ValueError, match="NSA runs only"):
        train(tiny_config("full", steps=1, wide_selection=(4, 2)), tiny_corpus, tmp_path / "full")


def test_minutes_budget_fixes_the_step_count(tiny_corpus, tmp_path):
    cfg = replace(tiny_config("full"), steps=None, minutes=0.05, calibration_steps=2)
    summary = train(cfg, tiny_corpus, tmp_path)
    assert summary["steps"] >= 5 and summary["config"]["steps"] == summary["steps"]


def test_lr_schedule_warms_up_then_decays():
    cfg = replace(tiny_config("full"), warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1) and lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(55, 100, cfg) < lr_at(20, 100, cfg) and lr_at(100, 100, cfg) == pytest.approx(0.1)

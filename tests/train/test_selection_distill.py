"""The selection loss (nsa_eval/train/selection_distill.py): its distributions, its gradient, that it
teaches compressed keys to rank a needle's block first, and its place in training and the long recipe."""

import json
from dataclasses import replace

import pytest
import torch

from nsa_eval.cli import main
from nsa_eval.train.long_context import long_stages
from nsa_eval.train.recipe import tiny_config, train
from nsa_eval.train.selection_distill import (
    answer_distill_loss,
    answer_positions,
    block_importance,
    block_mass,
    query_positions,
    selection_distill_loss,
)

GEOMETRY = dict(block_len=16, stride=8, select_size=32)


def compressed_len(T: int) -> int:
    return (T - GEOMETRY["block_len"]) // GEOMETRY["stride"] + 1


def needle_inputs(T=512, Hq=2, Hkv=1, D=16, needle=200, seed=0):
    """Queries sharing one direction, random keys and one key (the needle) along it: dense attention puts
    most of every later query's mass on the needle's block."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    q = 6 * u + 0.3 * torch.randn(1, T, Hq, D, generator=g)
    k = 0.3 * torch.randn(1, T, Hkv, D, generator=g)
    k[0, needle] = 6 * u
    return q, k


def test_block_mass_and_importance_are_distributions_over_visible_blocks():
    q, k = needle_inputs()
    positions = torch.tensor([100, 300, 511])
    g = torch.Generator().manual_seed(1)
    k_cmp = torch.randn(1, compressed_len(512), 1, 16, generator=g)
    mass = block_mass(q[:, positions], k, positions, select_size=32, scale=0.25)
    importance = block_importance(q[:, positions], k_cmp, positions, T=512, scale=0.25, **GEOMETRY)
    assert mass.shape == importance.shape == (1, 3, 1, 16)
    torch.testing.assert_close(mass.sum(-1), torch.ones(1, 3, 1))
    torch.testing.assert_close(importance.sum(-1), torch.ones(1, 3, 1))
    assert (mass[0, 0, 0, 4:] == 0).all()  # position 100 is in block 3: nothing after it
    assert (importance[0, 0, 0, 4:] == 0).all()
    assert mass[0, 1, 0].argmax() == 200 // 32 and mass[0, 1, 0, 200 // 32] > 0.5  # the needle's block


def test_positions_leave_out_the_forced_blocks_and_follow_the_generator():
    draw = lambda seed: query_positions(512, 8, select_size=32, num_init=1, num_local=2,  # noqa: E731
                                        generator=torch.Generator().manual_seed(seed))
    positions = draw(0)
    assert len(positions) == 8 and positions.min() >= 128 and (positions.diff() > 0).all()
    assert torch.equal(positions, draw(0)) and not torch.equal(positions, draw(1))
    assert len(query_positions(90, 8, select_size=32, num_init=1, num_local=2,
                               generator=torch.Generator())) == 0


def test_only_the_compressed_keys_learn_from_it():
    q, k = needle_inputs()
    q.requires_grad_(True)
    k.requires_grad_(True)
    k_cmp = torch.randn(1, compressed_len(512), 1, 16, requires_grad=True)
    loss = selection_distill_loss(q, k, k_cmp, num_init=1, num_local=2, scale=0.25, queries=16,
                                  generator=torch.Generator().manual_seed(0), **GEOMETRY)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    loss.backward()
    assert q.grad is None and k.grad is None
    assert k_cmp.grad is not None and k_cmp.grad.abs().sum() > 0


@pytest.mark.parametrize("lead", [40.0, 63.0, 100.0])
def test_a_forced_block_far_ahead_leaves_the_loss_and_its_gradient_unchanged(lead):
    """The initial block's compressed keys scoring `lead` x 1.5 nats above every other block (a trained
    NSA's compressed logits spread by hundreds, docs/training.md): the choosable blocks' importances
    underflow in probability space, but the loss is over those blocks alone, so it equals the loss
    with a modest lead, and its gradient stays finite (in probability space it overflowed to inf at
    a lead of 60-70, and NaN then took every weight). One query head a KV head, so that the importance
    over the choosable blocks does not depend on the forced block's (a group's heads normalise apart)."""
    q, k = needle_inputs(Hq=1)
    u = q[0, :, 0].mean(0)
    u = u / u.norm()  # the queries' shared direction

    def loss_and_grad(lead):
        k_cmp = 0.3 * torch.randn(1, compressed_len(512), 1, 16, generator=torch.Generator().manual_seed(1))
        k_cmp[0, :3, 0] = lead * u  # the compressed blocks inside selection block 0, always selected
        k_cmp.requires_grad_(True)
        loss = selection_distill_loss(q, k, k_cmp, num_init=1, num_local=2, scale=0.25, queries=16,
                                      generator=torch.Generator().manual_seed(0), **GEOMETRY)
        loss.backward()
        return loss, k_cmp.grad

    loss, grad = loss_and_grad(lead)
    modest, modest_grad = loss_and_grad(1.0)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    torch.testing.assert_close(loss, modest, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad[0, 3:], modest_grad[0, 3:], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("weights", [dict(selection_distill=1.0), dict(distill_answers=1.0)])
def test_in_the_model_only_the_compressor_and_its_key_projection_learn_from_it(tiny_corpus, weights):
    """Through a forward of the NSA model: the loss on the captured inputs (at random positions, or at
    the answer queries) reaches the compressor of the keys and the projection into it in every layer,
    and no other weight (the layer input is detached)."""
    from nsa_eval.train.recipe import _selection_distill, build_model

    cfg = tiny_config("nsa", seq_len=512, **weights)
    model = build_model("nsa", cfg.model, tiny_corpus.tokenizer)
    ids = torch.randint(3, 200, (2, 512), generator=torch.Generator().manual_seed(0))
    weights = torch.ones(2, 512)
    weights[1, 490:497] = cfg.mix.answer_weight  # the answer queries
    with model.capturing_selection_inputs() as captured:
        model(input_ids=ids, use_cache=False)
    loss = _selection_distill(model, cfg, captured, 0, weights)
    loss.backward()
    learning = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    layers = range(cfg.model.num_layers)
    assert learning == {f"model.layers.{i}.attn.{part}" for i in layers
                        for part in ("k_cmp_proj.weight", "compress_k.pos_emb", "compress_k.fc1.weight",
                                     "compress_k.fc2.weight")}


def test_it_teaches_compressed_keys_to_rank_the_needles_block_first():
    """Compressed keys that start random, trained on this loss alone, come to rank the needle's block
    first among the blocks a later query chooses from."""
    q, k = needle_inputs()
    g = torch.Generator().manual_seed(2)
    k_cmp = (0.3 * torch.randn(1, compressed_len(512), 1, 16, generator=g)).requires_grad_(True)
    positions = torch.tensor([320, 400, 480])
    choosable = slice(1, 8)  # past block 0 (initial), before the query's own two local blocks

    def needle_rank():
        with torch.no_grad():
            imp = block_importance(q[:, positions], k_cmp, positions, T=512, scale=0.25, **GEOMETRY)
        return [int((imp[0, i, 0, choosable] > imp[0, i, 0, 200 // 32]).sum()) for i in range(3)]

    before = needle_rank()
    optimizer = torch.optim.Adam([k_cmp], lr=0.05)
    losses = []
    for step in range(150):
        loss = selection_distill_loss(q, k, k_cmp, num_init=1, num_local=2, scale=0.25, queries=16,
                                      generator=torch.Generator().manual_seed(step), **GEOMETRY)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert max(before) > 0  # random keys do not rank it first
    assert needle_rank() == [0, 0, 0]
    assert sum(losses[-10:]) < 0.3 * sum(losses[:10])


def test_answer_positions_are_the_queries_before_answer_tokens_past_the_forced_blocks():
    answer = torch.zeros(3, 200, dtype=torch.bool)
    answer[0, [10, 150, 151, 152]] = True  # query 10 has no block to choose among yet (first: 4 x 32)
    answer[2, 128] = True
    rows = answer_positions(answer, select_size=32, num_init=1, num_local=2)
    assert [r.tolist() for r in rows] == [[150, 151, 152], [], [128]]


def test_at_the_answer_queries_it_is_each_rows_own_divergence_and_teaches_the_needle():
    """The answer term is the selection loss at each row's own positions: a row without any adds nothing,
    two rows give the mean over both rows' positions; trained on it alone, compressed keys come to rank
    the needle's block first at those queries."""
    q, k = needle_inputs()
    g = torch.Generator().manual_seed(2)
    k_cmp = (0.3 * torch.randn(1, compressed_len(512), 1, 16, generator=g)).requires_grad_(True)
    at = torch.tensor([400, 401, 402])

    def loss(k_cmp, answers, q=q, k=k):
        return answer_distill_loss(q, k, k_cmp, answers, num_init=1, num_local=2, scale=0.25, **GEOMETRY)

    one = loss(k_cmp, [at])
    q2, k2, c2 = (torch.cat([x, x.flip(1) if x is not k_cmp else x]) for x in (q, k, k_cmp))
    torch.testing.assert_close(loss(c2, [at, at[:0]], q2, k2), one)  # the empty second row adds nothing
    both = loss(c2, [at, at[:1]], q2, k2)
    second = loss(k_cmp, [at[:1]], q.flip(1), k.flip(1))
    torch.testing.assert_close(both, (3 * one + second) / 4)
    assert float(loss(k_cmp, [at[:0]]).detach()) == 0.0 and loss(k_cmp, [at[:0]]).requires_grad

    def outranking_the_needle():
        with torch.no_grad():
            imp = block_importance(q[:, at], k_cmp, at, T=512, scale=0.25, **GEOMETRY)
        return [int((imp[0, i, 0, 1:11] > imp[0, i, 0, 200 // 32]).sum()) for i in range(3)]

    assert max(outranking_the_needle()) > 0  # random keys do not rank it first
    optimizer = torch.optim.Adam([k_cmp], lr=0.05)
    for _ in range(150):
        optimizer.zero_grad()
        loss(k_cmp, [at]).backward()
        optimizer.step()
    assert outranking_the_needle() == [0, 0, 0]


def test_nsa_trains_with_it_and_logs_it(tiny_corpus, tmp_path):
    cfg = tiny_config("nsa", steps=2, log_every=1, seq_len=512, selection_distill=1.0)  # 3+ blocks to choose
    summary = train(cfg, tiny_corpus, tmp_path)
    assert summary["config"]["selection_distill"] == 1.0
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    distill = [r["distill_loss"] for r in rows if "distill_loss" in r]
    assert len(distill) == 2 and all(0 < d < 100 for d in distill)
    with pytest.raises(ValueError, match="selection_distill"):
        train(tiny_config("full", steps=1, selection_distill=1.0), tiny_corpus, tmp_path / "full")
    with pytest.raises(ValueError, match="distill_answers"):
        train(tiny_config("full", steps=1, distill_answers=1.0), tiny_corpus, tmp_path / "full")


def test_nsa_trains_with_the_answer_term_alone(tiny_corpus, tmp_path):
    """Retrieval rows at 512 tokens put answer queries past the forced blocks: the term is logged above 0."""
    cfg = tiny_config("nsa", steps=2, log_every=1, seq_len=512, distill_answers=1.0)
    cfg = replace(cfg, mix=replace(cfg.mix, retrieval_fraction=1.0, retrieval_lengths=(400, 480)))
    train(cfg, tiny_corpus, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    distill = [r["distill_loss"] for r in rows if "distill_loss" in r]
    assert len(distill) == 2 and all(0 < d < 100 for d in distill)


def test_the_long_recipe_variant_distills_its_long_nsa_stages_only(tmp_path):
    plain = {s.name: s for s in long_stages(tmp_path)}
    stages = {s.name: s for s in long_stages(tmp_path, selection_distill=0.5, distill_answers=2.0)}
    # nsa-nowindow-2k, nsa, full, nsa-nowindow
    assert [stages[n].config.selection_distill for n in stages] == [0.0, 0.5, 0.0, 0.5]
    assert [stages[n].config.distill_answers for n in stages] == [0.0, 2.0, 0.0, 2.0]
    for name in stages:
        assert replace(stages[name].config, selection_distill=0.0, distill_answers=0.0) == plain[name].config


def test_bad_weights_exit_2_before_work(tmp_path, capsys):
    base = ["train", "--out", str(tmp_path / "x"), "--steps", "3"]
    assert main([*base, "--attention", "nsa", "--selection-distill", "-1"]) == 2
    assert "--selection-distill must be a finite weight >= 0, got -1.0" in capsys.readouterr().err
    assert main([*base, "--attention", "full", "--selection-distill", "1"]) == 2
    assert "full attention has none" in capsys.readouterr().err
    assert main([*base, "--attention", "nsa", "--distill-answers", "nan"]) == 2
    assert "--distill-answers must be a finite weight >= 0, got nan" in capsys.readouterr().err
    assert main([*base, "--attention", "full", "--distill-answers", "1"]) == 2
    assert "--distill-answers trains NSA's block selection" in capsys.readouterr().err
    assert main([*base, "--attention", "full", "--far-needles", "1.5"]) == 2
    assert "--far-needles must be a share in [0, 1], got 1.5" in capsys.readouterr().err
    assert main(["train", "--recipe", "long", "--out", str(tmp_path / "x"), "--far-needles", "-0.1"]) == 2
    assert "--far-needles must be a share in [0, 1], got -0.1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

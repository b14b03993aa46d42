"""group_shared: one selection per KV head, the group's heads ranking keys by their summed probabilities."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.errors import UsageError
from nsa_eval.methods import METHODS, apply_attention, attention_stats
from tests.methods.conftest import random_qkv, run_attend

SELECTING = ["topk", "quest", "h2o"]
BUDGET, SINK, LOCAL = 32, 4, 8


def params(method: str, **extra) -> dict:
    return ({"page_size": 4} if method == "quest" else {}) | extra


@pytest.mark.parametrize("method", SELECTING)
def test_the_heads_of_a_group_keep_the_same_keys_within_the_budget(method):
    q, k, v = random_qkv(B=2, Hq=4, Hkv=2, T=64)
    _, keep = run_attend(method, q, k, v, budget=BUDGET, sink=SINK, local=LOCAL,
                         **params(method, group_shared=True))  # [B, Hq, T, S]
    grouped = keep.view(2, 2, 2, 64, 64)  # [B, Hkv, G, T, S]
    assert torch.equal(grouped[:, :, 0], grouped[:, :, 1])
    assert int(keep.sum(-1).max()) == BUDGET
    _, per_head = run_attend(method, q, k, v, budget=BUDGET, sink=SINK, local=LOCAL, **params(method))
    per_head = per_head.view(2, 2, 2, 64, 64)
    assert not torch.equal(per_head[:, :, 0], per_head[:, :, 1])  # without it the heads pick apart


@pytest.mark.parametrize("method", SELECTING)
def test_with_one_head_per_group_it_changes_nothing(method):
    """A softmax keeps each head's order, so a group of one picks what the head picks alone."""
    q, k, v = random_qkv(B=2, Hq=2, Hkv=2, T=64, seed=1)
    out_a, keep_a = run_attend(method, q, k, v, budget=BUDGET, sink=SINK, local=LOCAL,
                               **params(method, group_shared=True))
    out_b, keep_b = run_attend(method, q, k, v, budget=BUDGET, sink=SINK, local=LOCAL, **params(method))
    assert torch.equal(keep_a, keep_b)
    torch.testing.assert_close(out_a, out_b)


def test_topk_keeps_the_keys_with_the_largest_summed_probabilities():
    q, k, v = random_qkv(B=1, Hq=4, Hkv=2, T=64, seed=2)
    _, keep = run_attend("topk", q, k, v, budget=BUDGET, sink=SINK, local=LOCAL, group_shared=True)
    T = 64
    logits = torch.einsum("bhtd,bhsd->bhts", q, k.repeat_interleave(2, dim=1)) * q.shape[-1] ** -0.5
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = s <= t  # [T, S]
    probs = logits.masked_fill(~visible, -torch.inf).softmax(-1)  # [B, Hq, T, S]
    group = probs.view(1, 2, 2, T, T).sum(2)  # [B, Hkv, T, S]
    forced = visible & ((s < SINK) | (s > t - LOCAL))
    for row in range(BUDGET, T):  # the queries that see more keys than the budget
        for h in range(2):
            score = group[0, h, row].masked_fill(~(visible[row] & ~forced[row]), -torch.inf)
            want = forced[row].clone()
            want[score.topk(BUDGET - int(forced[row].sum())).indices] = True
            assert torch.equal(keep[0, 2 * h, row], want), (row, h)


def test_a_kv_head_then_reads_the_budget(model):
    ids = torch.randint(3, 128, (2, 96), generator=torch.Generator().manual_seed(2))
    apply_attention(model, "topk", budget=40, sink=4, local=8, group_shared=True)
    with torch.no_grad():
        model(ids, use_cache=False)
    stats = attention_stats(model)
    assert stats["kv_read_mean"] == pytest.approx(stats["mean"])  # the group's union is its one selection
    assert stats["max"] == 40


def test_group_shared_must_be_a_bool():
    with pytest.raises(UsageError, match="group_shared must be true or false"):
        METHODS.get("topk")(group_shared="yes")

"""Decode steps of an unpadded batch (`AttentionController._decode`): the same keys, outputs, state and
counts as the general chunked path, which a mask of all ones takes, and no wait for the device."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.methods import METHODS, BudgetExceededError, apply_attention, attention_stats
from nsa_eval.methods.base import BudgetConfig
from nsa_eval.methods.controller import AttentionController
from tests.methods.conftest import SPARSE_METHODS, attended, fake_module, one_hot, random_qkv, tiny_llama

CASES = [
    ("sink_window", {}, 8),
    ("topk", {}, 8),
    ("topk", {"group_shared": True}, 8),
    ("quest", {}, 8),  # local < page_size: the query's page reaches past the local window
    ("quest", {}, 16),
    ("quest", {"group_shared": True}, 16),
    ("h2o", {}, 8),
    ("h2o", {"group_shared": True}, 8),
]


def _decode_run(method, params, local, mode, prompt, steps=14, budget=32, sink=4, dtype=torch.float32):
    """A prefill of `prompt` keys, then `steps` decode calls, by `mode`: "decode" (no mask: `_decode`),
    "chunked" (no mask, `_decode` turned off: the chunked path as before it) or "masked" (a 4D mask of
    all ones: the general path of a padded batch). Returns outputs, keeps, counts, state, controller;
    the keeps from a second controller making the same calls on one-hot values (`attended`)."""
    q, k, v = (x.to(dtype) for x in random_qkv(B=2, T=prompt + steps, seed=3))
    eye = one_hot(v)  # [B, Hkv, prompt + steps, prompt + steps]
    config = BudgetConfig(budget, sink, local)
    controller, observer = (AttentionController(METHODS.get(method)(**params), config) for _ in range(2))
    if mode == "chunked":
        controller._decode_plan = observer._decode_plan = lambda S: None
    module = fake_module(groups=2)
    controller.attend(module, q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], None, None)
    observer.attend(module, q[:, :, :prompt], k[:, :, :prompt], eye[:, :, :prompt], None, None)
    outs, keeps = [], []
    for t in range(prompt, prompt + steps):
        S = t + 1
        mask = torch.ones(1, 1, 1, S, dtype=torch.bool) if mode == "masked" else None
        query, key = q[:, :, t:t + 1], k[:, :, :S]
        outs.append(controller.attend(module, query, key, v[:, :, :S], mask, None))
        keeps.append(attended(observer.attend(module, query, key, eye[:, :, :S], mask, None)))
    state = {n: t.clone() for n, t in controller.states[0].tensors.items()} if controller.states else {}
    return outs, keeps, controller.stats.summary(), state, controller


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prompt", [20, 40])  # decode crossing the budget (32), and past it throughout
@pytest.mark.parametrize(("method", "params", "local"), CASES)
def test_unpadded_decode_matches_the_chunked_path(method, params, local, prompt, dtype):
    fast = _decode_run(method, params, local, "decode", prompt, dtype=dtype)
    references = ["chunked"]
    if METHODS.get(method).selects:  # sink_window's chunked path reads only its keys: other rounding
        references.append("masked")
    for mode in references:
        reference = _decode_run(method, params, local, mode, prompt, dtype=dtype)
        for a, b in zip(fast[0], reference[0], strict=True):
            assert torch.equal(a, b), mode  # bit for bit
        assert len(fast[1]) == len(reference[1])
        for a, b in zip(fast[1], reference[1], strict=True):
            assert torch.equal(a, b), mode
        assert fast[2] == reference[2], mode
        assert fast[3].keys() == reference[3].keys()
        for name in fast[3]:
            assert torch.equal(fast[3][name], reference[3][name]), mode
        assert not reference[4]._unchecked
    if METHODS.get(method).selects:  # the decode path took these steps, leaving their check for later
        assert fast[4]._unchecked


def test_decode_budget_check_waits_for_a_read(monkeypatch):
    """A decode step over the budget raises at the next check (`check_budget`: a held prefill, or the
    statistics read), not inside the step."""
    q, k, v = random_qkv(B=1, T=48)
    controller = AttentionController(METHODS.get("topk")(), BudgetConfig(16, 2, 4))
    module = fake_module(groups=2)
    controller.attend(module, q[:, :, :40], k[:, :, :40], v[:, :, :40], None, None)
    monkeypatch.setattr(controller, "_decode_keep", lambda score, plan, Hq: torch.ones(
        score.shape[0], Hq, *score.shape[2:], dtype=torch.bool))
    controller.attend(module, q[:, :, 40:41], k[:, :, :41], v[:, :, :41], None, None)  # no raise here
    with pytest.raises(BudgetExceededError, match="layer 0: a query attended to 41 keys"):
        controller.check_budget()
    controller.check_budget()  # checked once
    controller.attend(module, q[:, :, 41:42], k[:, :, :42], v[:, :, :42], None, None)
    with pytest.raises(BudgetExceededError, match="over the budget of 16"):  # the next held prefill
        controller.attend(module, q[:, :, 40:44], k[:, :, :44], v[:, :, :44], None, None)


def test_decode_budget_check_at_attention_stats(monkeypatch):
    model = tiny_llama()
    apply_attention(model, "quest", budget=24, sink=2, local=16)
    controller = model._nsa_eval_controller
    ids = torch.randint(3, 128, (1, 30))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        monkeypatch.setattr(controller, "_decode_keep", lambda score, plan, Hq: torch.ones(
            score.shape[0], Hq, *score.shape[2:], dtype=torch.bool))
        model(ids[:, :1], cache=out.past_key_values, use_cache=True)
    with pytest.raises(BudgetExceededError):
        attention_stats(model)


def test_h2o_mass_grows_in_a_buffer():
    """The decode steps' mass is a view onto a buffer copied once per GROWTH keys, not at every step."""
    from nsa_eval.methods.h2o import GROWTH

    *_, controller = _decode_run("h2o", {}, 8, "decode", 40, steps=3)
    mass = controller.states[0].tensors["mass"]
    assert mass.shape[-1] == 43 and mass._base is not None and mass._base.shape[-1] == 41 + GROWTH


@pytest.mark.gpu
@pytest.mark.parametrize("group_shared", [False, True])
@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_decode_step_never_waits_for_the_gpu(method, group_shared):
    """Every layer's attention in a decode step (unpadded batch, past the budget and before it) runs
    with no device-to-host synchronisation (`torch.cuda.set_sync_debug_mode("error")`)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if group_shared and method == "sink_window":
        pytest.skip("sink_window selects nothing")
    model = tiny_llama().cuda().to(torch.bfloat16)
    params = {"group_shared": True} if group_shared else {}
    apply_attention(model, method, budget=32, sink=4, local=16, **params)
    controller = model._nsa_eval_controller
    attend, calls = controller.attend, []

    def strict_attend(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return attend(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            calls.append(1)

    for prompt in (20, 40):  # the decode steps cross the budget (32), or start past it
        ids = torch.randint(3, 128, (2, prompt), device="cuda")
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            controller.attend = strict_attend
            try:
                for _ in range(16):
                    out = model(nxt, cache=cache, use_cache=True)
                    nxt = out.logits[:, -1:].argmax(-1)
            finally:
                controller.attend = attend
    assert len(calls) == 2 * 16 * 2  # prompts x steps x layers
    attention_stats(model)  # the deferred budget check passes


def _aten_ops(model, ids, cache=None) -> list[str]:
    """The aten ops one forward of `model` on `ids` dispatches (every tensor op, on any device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    record = Record()
    with torch.no_grad(), record:
        model(ids, past_key_values=cache, use_cache=cache is not None)
    return record.ops


@pytest.mark.parametrize("batch", [1, 3])
def test_full_adds_no_tensor_op_to_plain_sdpa(batch):
    """`full` on an unpadded batch counts its keys on the host: a prefill and a decode step dispatch exactly
    the ops of transformers' `sdpa` (so eager decoding pays no per-layer device work for the statistics),
    and the statistics still count every key."""
    ids = torch.randint(3, 128, (batch, 21), generator=torch.Generator().manual_seed(2))
    ops, caches = {}, {}
    for name in ("sdpa", "full"):
        model = tiny_llama()
        if name == "sdpa":
            model.set_attn_implementation("sdpa")
        else:
            apply_attention(model, "full")
        with torch.no_grad():
            caches[name] = model(ids[:, :20], use_cache=True).past_key_values
        ops[name] = (_aten_ops(model, ids[:, :20]), _aten_ops(model, ids[:, 20:], caches[name]))
    assert ops["full"] == ops["sdpa"]
    stats = attention_stats(model)  # 20 + 1 queries per row, head and layer, each up to its own position
    assert stats["queries"] == 2 * 4 * batch * 41 and stats["max"] == 21
    assert stats["phases"]["decode"]["mean"] == 21
    assert stats["phases"]["prefill"]["mean"] == pytest.approx(10.5)

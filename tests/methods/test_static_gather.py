"""The static decode step's gathered attention (static_decode.py's `gathered_attend`: the kept slots listed,
gathered and attended) against its masked reference over the whole width (`masked_attend`), on one layer's
random tensors: the same kept slots, output, counts and H2O mass, for rows held to the budget and rows under
it, at different lengths in one batch."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.methods import _build
from nsa_eval.methods.static_decode import gathered_attend, kept_mask, kept_slots, masked_attend, select_step

B, HQ, HKV, D = 5, 4, 2, 8
CASES = [
    ("topk", dict(budget=32, sink=4, local=8), {}),
    ("topk", dict(budget=32, sink=4, local=8), {"group_shared": True}),
    ("topk", dict(budget=32, sink=0, local=8), {}),
    ("topk", dict(budget=12, sink=4, local=8), {}),  # forced alone fill the budget: no picks
    ("quest", dict(budget=32, sink=4, local=16), {}),
    ("quest", dict(budget=32, sink=4, local=8), {}),  # local < page_size: the query's page reaches further
    ("quest", dict(budget=32, sink=4, local=8), {"page_size": 8}),
    ("quest", dict(budget=32, sink=4, local=16), {"group_shared": True}),
    ("h2o", dict(budget=32, sink=4, local=8), {}),
    ("h2o", dict(budget=32, sink=4, local=8), {"group_shared": True}),
]
# a row's keys S: under the budget, at it, one over it, past it, the whole width
LENGTHS = {64: [7, 32, 33, 50, 64], 24: [1, 9, 17, 24, 24]}  # width: lengths (24: no row held)


def layer_inputs(method, W: int, S: torch.Tensor, dtype=torch.float32, seed: int = 0):
    """query `[B, Hq, 1, D]`, key/value `[B, Hkv, W, D]` views of 80-slot buffers, and the layer's static
    state (Quest's page bounds of each row's S keys; H2O's mass over slots below S - 1, some evicted)."""
    g = torch.Generator().manual_seed(seed)
    C = 80
    query = (torch.randn(B, HQ, 1, D, generator=g) * 2).to(dtype)
    keys = (torch.randn(B, HKV, C, D, generator=g) * 2).to(dtype)
    values = torch.randn(B, HKV, C, D, generator=g).to(dtype)
    slots = torch.arange(C)
    unwritten = slots >= S[:, None]  # [B, C]
    keys.masked_fill_(unwritten[:, None, :, None], 0.0)
    values.masked_fill_(unwritten[:, None, :, None], 0.0)
    state = {}
    if method.name == "quest":
        state = method.static_state(keys, S, C, None)
    if method.name == "h2o":
        mass = torch.rand(B, HQ, C, generator=g) * (torch.rand(B, HQ, C, generator=g) > 0.2)
        mass = mass.masked_fill(slots >= S[:, None, None] - 1, 0.0)  # this step's key and later: no mass
        state = method.static_state(keys, S - 1, C, {"mass": mass})
    return query, keys[:, :, :W], values[:, :, :W], state


@pytest.mark.parametrize("W", sorted(LENGTHS))
@pytest.mark.parametrize(("name", "budget", "params"), CASES)
def test_gathered_step_equals_the_masked_step(name, budget, params, W):
    method, cfg = _build(name, sparse_prefill=True, dense_layers=0, method_params=params, **budget)
    S = torch.tensor(LENGTHS[W])
    query, key, value, state = layer_inputs(method, W, S)
    twin = {name: t.clone() for name, t in state.items()}  # the reference's own state
    step = select_step(method, cfg, query, key, D**-0.5, S, state)
    reference = select_step(method, cfg, query, key, D**-0.5, S, twin)
    assert torch.equal(step.top, reference.top) and torch.equal(step.ok, reference.ok)

    index, valid = kept_slots(step, cfg.sink, min(W, cfg.budget))  # [B, R, n]
    listed = torch.zeros(B, index.shape[1], W + 1, dtype=torch.bool).scatter_(
        -1, index.masked_fill(~valid, W), True)[..., :W]
    want = kept_mask(step, cfg.sink)  # [B, R, W]
    assert torch.equal(listed, want)  # no kept slot lost, none added
    assert torch.equal(valid.sum(-1), want.sum(-1))  # and none listed twice
    assert int(want.sum(-1).max()) <= cfg.budget

    out, activated, kv_read = gathered_attend(method, cfg, step, query, key, value, D**-0.5)
    out_ref, activated_ref, kv_read_ref = masked_attend(method, cfg, reference, query, key, value, D**-0.5)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(activated, activated_ref) and torch.equal(kv_read, kv_read_ref)
    for name in state:
        torch.testing.assert_close(state[name], twin[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("name", "budget", "params"), [CASES[0], CASES[5], CASES[9]])
def test_gathered_step_in_bfloat16(name, budget, params):
    """bf16 keys and values (a GPU's model dtype): the same keys and counts, the output to bf16 rounding."""
    method, cfg = _build(name, sparse_prefill=True, dense_layers=0, method_params=params, **budget)
    S = torch.tensor(LENGTHS[64])
    query, key, value, state = layer_inputs(method, 64, S, torch.bfloat16, seed=1)
    twin = {name: t.clone() for name, t in state.items()}
    step = select_step(method, cfg, query, key, D**-0.5, S, state)
    reference = select_step(method, cfg, query, key, D**-0.5, S, twin)
    out, activated, kv_read = gathered_attend(method, cfg, step, query, key, value, D**-0.5)
    out_ref, activated_ref, kv_read_ref = masked_attend(method, cfg, reference, query, key, value, D**-0.5)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(activated, activated_ref) and torch.equal(kv_read, kv_read_ref)
    for name in state:
        torch.testing.assert_close(state[name], twin[name], rtol=1e-3, atol=1e-5)


def test_h2o_static_update_equals_the_scattered_update():
    """H2O's update at the listed slots equals the base's: the probs scattered over all slots, then
    `update_state` (its invalid entries repeat a slot; a row that keeps nothing evicts nothing)."""
    from nsa_eval.methods.base import AttentionMethod

    method, _ = _build("h2o", 32, 4, 8, True, 0, {})
    g = torch.Generator().manual_seed(3)
    mass = torch.rand(2, HQ, 40, generator=g)
    index = torch.randperm(40, generator=g)[:12].expand(2, HQ, 12).clone()
    kept = torch.rand(2, HQ, 12, generator=g) > 0.3
    kept[1, 2] = False  # keeps nothing
    index[0, :, -3:] = index[0, :, :1]  # invalid entries on a kept slot
    kept[0, :, -3:] = False
    probs = torch.rand(2, HQ, 12, generator=g).masked_fill(~kept, 0.0)
    ours, theirs = {"mass": mass.clone()}, {"mass": mass.clone()}
    method.static_update(ours, probs, index, kept)
    AttentionMethod.static_update(method, theirs, probs, index, kept)
    assert torch.equal(ours["mass"], theirs["mass"])
    assert torch.equal(ours["mass"][1, 2], mass[1, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["topk", "quest", "h2o"])
def test_gpu_gathered_step_at_llama_1b_shape(name):
    """Llama-3.2-1B's decode shape (32 query and 8 KV heads, D = 64) over a 32k width of a bf16 cache, two
    rows (one held, one under the budget), the default budget: the masked step's slots and counts, its
    output to bf16 rounding, and both steps' GPU times (printed)."""
    import dataclasses

    from tests.methods.budget_inputs import cuda_ms

    method, cfg = _build(name, 2560, 128, 512, True, 0, {})
    g = torch.Generator(device="cuda").manual_seed(0)
    W, C = 32768, 33792
    S = torch.tensor([30000, 2000], device="cuda")
    query = torch.randn(2, 32, 1, 64, generator=g, device="cuda").to(torch.bfloat16)
    keys = torch.randn(2, 8, C, 64, generator=g, device="cuda").to(torch.bfloat16)
    values = torch.randn(2, 8, C, 64, generator=g, device="cuda").to(torch.bfloat16)
    state = {}
    if name == "quest":
        state = method.static_state(keys, S, C, None)
    if name == "h2o":
        mass = torch.rand(2, 32, C, generator=g, device="cuda")
        state = {"mass": mass.masked_fill(torch.arange(C, device="cuda") >= S[:, None, None] - 1, 0.0)}
    key, value = keys[:, :, :W], values[:, :, :W]
    step = select_step(method, cfg, query, key, 0.125, S, state)
    twin = dataclasses.replace(step, tensors=None if step.tensors is None else {
        n: t.clone() for n, t in step.tensors.items()})
    index, valid = kept_slots(step, cfg.sink, cfg.budget)
    listed = torch.zeros(2, index.shape[1], W + 1, dtype=torch.bool, device="cuda").scatter_(
        -1, index.masked_fill(~valid, W), True)[..., :W]
    assert torch.equal(listed, kept_mask(step, cfg.sink))
    out, activated, kv_read = gathered_attend(method, cfg, step, query, key, value, 0.125)
    out_ref, activated_ref, kv_read_ref = masked_attend(method, cfg, twin, query, key, value, 0.125)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(activated, activated_ref) and torch.equal(kv_read, kv_read_ref)
    if name == "h2o":
        torch.testing.assert_close(step.tensors["mass"], twin.tensors["mass"], rtol=1e-4, atol=1e-6)
    gathered_ms = cuda_ms(lambda: gathered_attend(method, cfg, step, query, key, value, 0.125), n=10)
    fresh = lambda: dataclasses.replace(twin, chunk=dataclasses.replace(twin.chunk))  # noqa: E731 (no cached logits)
    masked_ms = cuda_ms(lambda: masked_attend(method, cfg, fresh(), query, key, value, 0.125), n=10)
    print(f"{name}: one layer's attention over the kept slots {gathered_ms:.3f} ms, masked over 32k "
          f"{masked_ms:.3f} ms")

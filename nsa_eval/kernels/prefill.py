"""Triton NSA for prefill and training: the three branches and their gated sum as one autograd op.

Forward: the compression branch (its lse also feeds the selection), `select_blocks`, the selected
branch, the sliding window, then `g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa` in one pass (or, with
`GATE_IN_SELECTED`, in the selected forward's last launch: by default the merge of the forward per key
block, where it runs).

Backward (`FUSED_BACKWARD`, the default): the gate backward writes each branch's copy g_x * do and
also its softmax row term delta_x = g_x * dg_x (it sums o_x * do for dg_x anyway), so no branch runs
its own delta pass over o_x and do_x (with `GATE_IN_BRANCHES`, a memory saving that costs time,
each branch's kernels take do and g_x and apply the gate themselves, ds = g_x * p * (dp - dg_x), and
no copy is written). The three branches' dq, the selected one still in its float32 accumulator, are
summed with one rounding (`DQ_SUM`): by the compression's dq kernel, launched last, in its epilogue
(no pass of their own), or by one pass `sum3`. Each branch's copy of the output gradient is freed
once that branch is done, so the backward holds no more than the composed one.
Once differentiable (no double backward). With `FUSED_BACKWARD = False` the branches are composed
from their own autograd functions (`compressed_attention`, `selected_attention`,
`sliding_window_attention`, `gated_sum`), as before; the benchmark times both.

`WINDOW_STREAM`: the window branch depends on no other branch, so its forward (once the compression
forward is queued) and its backward run on a second CUDA stream, beside the selection's top-k and
selected walks, which leave the tensor cores idle (they wait on L2 reads, atomics and reductions).
The streams join before the op returns.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from nsa_eval.kernels._triton_utils import contiguous, default_scale, interpreting
from nsa_eval.kernels.band import band_backward_dkv, band_backward_dq, band_forward
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.gates import gate_backward, gate_forward, gated_sum, sum3
from nsa_eval.kernels.importance import select_blocks
from nsa_eval.kernels.selection import (
    by_block,
    selected_attention,
    selected_backward,
    selected_forward,
    selected_forward_gated,
)
from nsa_eval.kernels.window import sliding_window_attention

FUSED_BACKWARD = True
# with FUSED_BACKWARD: each branch's backward kernels take the output gradient do and the branch's gate
# and apply it themselves (the band dq and the dq walk scale dq by g at the end; dk/dv kernels scale p
# by g), instead of the gate backward writing g_x * do for each branch (three copies of do). A memory
# saving that costs time: run 56 (scripts/probe_prefill.py gates), forward+backward at 64k, 64/4 heads:
# 136.6 ms against 128.1 with the copies, peak 7.49 GiB above the inputs against 9.58 (16/4 heads: 45.1
# against 43.3 ms, 2.01 against 2.76 GiB; 192 / 128: 208.5 against 204.8 ms, 9.09 against 11.09 GiB),
# as the gate in the banded dk/dv loop spills more (compression 808 bytes against 604)
GATE_IN_BRANCHES = False
# the window branch on a second CUDA stream (with FUSED_BACKWARD), beside the other branches
WINDOW_STREAM = True
# with FUSED_BACKWARD: the gated sum of the three outputs written by the selected forward's last launch
# (`selection.selected_forward_gated`, once the window's output is done), instead of a pass of its own
# (`gates.gate_forward`) that reads o_slc back; without gradients o_slc is not stored at all.
# - "by block": where the forward runs per key block (`selection.by_block`), in its merge, which reads
#   the window's output after the block-major kernel, so the window still runs beside that.
# - "auto" (the default): as "by block", and in the walk's epilogue up to GATE_IN_WALK_MAX_ROWS key
#   rows (B x T x Hkv), where the walk's wait for the window costs less than the pass.
# - True: in both forwards at any length; False: nowhere.
# Run 122 (scripts/probe_by_block.py gate), NSA forward, three rounds in alternation, apart / by block /
# True: G = 4 at 8k 1.119-1.126 / 1.098-1.121 / 1.112-1.115 ms, 16k 2.271-2.279 / 2.256-2.263, 32k
# 4.900-4.915 / 4.862-4.869, 64k 11.415-11.509 / 11.427-11.453; G = 16 (the walk) at 8k 2.346-2.357
# against 2.298-2.304 in the epilogue, 16k 5.302-5.345 against 5.214-5.240, but 32k 12.455-12.639
# against 12.546-12.884 and 64k 32.308-32.902 against 32.703-33.295, as in run 96 (64k 32.83-34.75
# against 33.22-33.50; the walk waits for the window and reads the two outputs). The benchmark times
# the gate apart (`[gated sum apart]`).
GATE_IN_SELECTED: bool | str = "auto"
GATE_IN_SELECTED_CHOICES = (False, True, "by block", "auto")
GATE_IN_WALK_MAX_ROWS = 16384 * 4
# How the fused backward sums the three branches' dq. "sum3": the selected branch's float32 atomics go
# to a zeroed buffer and one pass `sum3` adds the three dq afterwards. "fold": the compression's dq
# kernel runs last (after its dk/dv) and adds the selected float32 dq and the window's dq in its
# epilogue (no sum pass). "chain": the window's dq kernel writes float32, the selected atomics add to
# that (no zeroed buffer), and the compression's dq kernel adds the sum (neither pass). Run 94
# (scripts/probe_band.py dqsum, Triton 3.8), 64k forward+backward, 64/4 heads, four rounds in
# alternation: sum3 109.96-112.40 ms, fold 111.33-112.47, chain 111.51-112.04 (16/4: 38.87-39.51,
# 39.67-40.28, 39.62-39.72): the same time within the spread, as the epilogue's reads cost what the
# passes did, but a peak of 8.57 GiB above the inputs against 9.56 (fold) and 10.72 (sum3).
DQ_SUM = "chain"
DQ_SUMS = ("sum3", "fold", "chain")
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(x: torch.Tensor) -> torch.cuda.Stream | None:
    """The second stream of x's device (None on the CPU, under the interpreter or without
    WINDOW_STREAM), made to wait for the work queued so far on the current stream."""
    if not (WINDOW_STREAM and x.is_cuda and not interpreting()):
        return None
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _join(side: torch.cuda.Stream | None, *made_there: torch.Tensor) -> None:
    """The current stream waits for `side`; tensors allocated there are marked as used here, so the
    allocator does not hand their memory out again before this stream is done with them."""
    if side is None:
        return
    main = torch.cuda.current_stream(side.device)
    main.wait_stream(side)
    for t in made_there:
        t.record_stream(main)


def gate_in_selected(G: int, kv_rows: int) -> bool:
    """Whether the selected forward writes NSA's gated output (`GATE_IN_SELECTED`) for a group of G
    query heads over `kv_rows` = B x T x Hkv key rows."""
    if GATE_IN_SELECTED not in GATE_IN_SELECTED_CHOICES:
        raise ValueError(f"GATE_IN_SELECTED must be one of {GATE_IN_SELECTED_CHOICES}, "
                         f"got {GATE_IN_SELECTED!r}")
    if GATE_IN_SELECTED in (False, True):
        return GATE_IN_SELECTED
    per_block = by_block(G, kv_rows)
    return per_block or (GATE_IN_SELECTED == "auto" and kv_rows <= GATE_IN_WALK_MAX_ROWS)


class NSAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, params, needs_grad):
        # needs_grad: a backward may follow (grad mode on, an input requiring a gradient; inside
        # forward grad mode is always off, and ctx.needs_input_grad ignores torch.no_grad)
        block_len, stride, select_size, num_selected, num_init, num_local, window, scale = params
        q, k, v, k_cmp, v_cmp, k_swa, v_swa = contiguous(q, k, v, k_cmp, v_cmp, k_swa, v_swa)
        gate_in = gate_in_selected(q.shape[2] // k.shape[2], k.shape[0] * k.shape[1] * k.shape[2])
        o_cmp, lse_cmp = band_forward(q, k_cmp, v_cmp, scale=scale, key_stride=stride,
                                      key_offset=block_len - 1)
        side = _side_stream(q)  # the window after the compression forward, beside the selection
        with torch.cuda.stream(side):  # no-op for None
            o_swa, lse_swa = band_forward(q, k_swa, v_swa, scale=scale, key_stride=1, key_offset=0,
                                          window=window)
        bi = select_blocks(q, k_cmp, block_len=block_len, stride=stride, select_size=select_size,
                           num_selected=num_selected, num_init=num_init, num_local=num_local, scale=scale,
                           lse=lse_cmp)  # int32 [B, T, Hkv, n], contiguous
        g_cmp, g_slc, g_swa = contiguous(g_cmp, g_slc, g_swa)
        if gate_in:  # the selected forward's last launch reads the window's output: the streams join first
            o, o_slc, lse_slc = selected_forward_gated(q, k, v, bi, o_cmp, o_swa, g_cmp, g_slc, g_swa,
                                                       select_size=select_size, scale=scale,
                                                       keep_o=needs_grad, presorted=True,
                                                       before_sum=lambda: _join(side, o_swa, lse_swa))
        else:
            o_slc, lse_slc = selected_forward(q, k, v, bi, select_size=select_size, scale=scale,
                                              presorted=True)
            _join(side, o_swa, lse_swa)
            o = gate_forward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)
        ctx.save_for_backward(q, k, v, k_cmp, v_cmp, k_swa, v_swa, g_cmp, g_slc, g_swa, bi,
                              o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa)
        ctx.params = params
        ctx.mark_non_differentiable(bi)
        ctx.set_materialize_grads(False)  # no zeros for the block indices' gradient
        return o, bi

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dbi):
        (q, k, v, k_cmp, v_cmp, k_swa, v_swa, g_cmp, g_slc, g_swa, bi,
         o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa) = ctx.saved_tensors
        block_len, stride, select_size, _, _, _, window, scale = ctx.params
        in_branches = GATE_IN_BRANCHES
        do = do.contiguous()
        d_o, d_g, delta = gate_backward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, do, with_delta=True,
                                        scaled_do=not in_branches)
        if in_branches:  # every branch reads do itself and applies its gate
            d_o = [do] * 3
        gates = [g_cmp, g_slc, g_swa] if in_branches else [None] * 3
        band = dict(scale=scale, key_stride=stride, key_offset=block_len - 1)
        window_band = dict(scale=scale, key_stride=1, key_offset=0, window=window, gate=gates[2])
        side = _side_stream(q)  # the window beside the selected branch
        do_swa = d_o.pop(2)  # held until the streams join: the side stream reads it
        with torch.cuda.stream(side):  # no-op for None
            # "chain": the window's dq is the float32 accumulator the selected backward adds to
            dq_swa = band_backward_dq(q, k_swa, v_swa, lse_swa, do_swa, delta[2], **window_band,
                                      dtype=torch.float32 if DQ_SUM == "chain" else None)
            swa_dq_done = torch.cuda.Event() if side is not None else None
            if swa_dq_done is not None:
                swa_dq_done.record(side)
            dk_swa, dv_swa = band_backward_dkv(q, k_swa, v_swa, lse_swa, do_swa, delta[2], **window_band)
        if side is None:
            del do_swa
        do_cmp, do_slc = d_o
        del d_o  # each branch's do_x is dropped as soon as that branch is done
        if DQ_SUM == "sum3":
            dq_slc, dk, dv = selected_backward(q, k, v, bi, o_slc, lse_slc, do_slc, select_size=select_size,
                                               scale=scale, delta=delta[1], dq_float32=True, gate=gates[1],
                                               presorted=True)
            del do_slc
            dq_cmp = band_backward_dq(q, k_cmp, v_cmp, lse_cmp, do_cmp, delta[0], **band, gate=gates[0])
            dk_cmp, dv_cmp = band_backward_dkv(q, k_cmp, v_cmp, lse_cmp, do_cmp, delta[0], **band,
                                               gate=gates[0], split_heads=True)
            del do_cmp
            _join(side, dq_swa, dk_swa, dv_swa)
            dq = sum3(dq_slc, dq_cmp, dq_swa, q.dtype, out=dq_cmp)  # dq_cmp: q's dtype and shape
        else:  # the compression's dq kernel goes last and adds the other branches' dq
            chain = DQ_SUM == "chain"
            if chain:  # the selected atomics wait for the window's dq: the compression's dk/dv first
                dk_cmp, dv_cmp = band_backward_dkv(q, k_cmp, v_cmp, lse_cmp, do_cmp, delta[0], **band,
                                                   gate=gates[0], split_heads=True)
                if swa_dq_done is not None:
                    torch.cuda.current_stream(q.device).wait_event(swa_dq_done)
                    dq_swa.record_stream(torch.cuda.current_stream(q.device))
            dq_slc, dk, dv = selected_backward(q, k, v, bi, o_slc, lse_slc, do_slc, select_size=select_size,
                                               scale=scale, delta=delta[1], dq_float32=True, gate=gates[1],
                                               presorted=True, dq_into=dq_swa if chain else None)
            del do_slc
            if not chain:  # the selected walk beside the window, as with "sum3"
                dk_cmp, dv_cmp = band_backward_dkv(q, k_cmp, v_cmp, lse_cmp, do_cmp, delta[0], **band,
                                                   gate=gates[0], split_heads=True)
            _join(side, dq_swa, dk_swa, dv_swa)
            add = (dq_slc,) if chain else (dq_slc, dq_swa)
            dq = band_backward_dq(q, k_cmp, v_cmp, lse_cmp, do_cmp, delta[0], **band, gate=gates[0], add=add)
        return (dq, dk, dv, dk_cmp, dv_cmp, *d_g, dk_swa, dv_swa, None, None)


def nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, k_swa=None, v_swa=None, block_len=32,
                  stride=16, select_size=64, num_selected=16, num_init=1, num_local=2, window=512, scale=None,
                  return_block_indices=False):
    """NSA prefill/training, `g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa`, through the Triton
    kernels (inputs already validated; see `nsa_eval.kernels.nsa_attention`).

    q `[B, T, Hq, Dk]`; k, v (and k_swa, v_swa, default k, v) `[B, T, Hkv, Dk/Dv]`; k_cmp, v_cmp
    `[B, Tc, Hkv, Dk/Dv]`; gates `[B, T, Hq]`. Returns o `[B, T, Hq, Dv]` (and the int32
    `[B, T, Hkv, num_selected]` block indices if asked).
    """
    k_swa = k if k_swa is None else k_swa
    v_swa = v if v_swa is None else v_swa
    scale = default_scale(scale, q.shape[-1])
    if FUSED_BACKWARD:
        params = (block_len, stride, select_size, num_selected, num_init, num_local, window, scale)
        inputs = (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        o, bi = NSAFunction.apply(*inputs, params, needs_grad)
    else:
        o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, block_len=block_len, stride=stride, scale=scale)
        # the selection reuses the compression lse instead of recomputing it
        bi = select_blocks(q, k_cmp, block_len=block_len, stride=stride, select_size=select_size,
                           num_selected=num_selected, num_init=num_init, num_local=num_local, scale=scale,
                           lse=lse.detach())
        o_slc = selected_attention(q, k, v, bi, select_size=select_size, scale=scale)
        o_swa = sliding_window_attention(q, k_swa, v_swa, window=window, scale=scale)
        o = gated_sum(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)  # [B, T, Hq, Dv], one fused pass
    return (o, bi) if return_block_indices else o

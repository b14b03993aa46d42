"""Triton NSA for prefill and training: the three branches and their gated sum as one autograd op.

Forward: the compression branch (its lse also feeds the selection), `select_blocks`, the selected
branch, the sliding window, then `g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa`: written by the
selected forward's last launch where that costs less than a pass of its own (`writes_gated_sum`), else
by one pass (`gates.gate_forward`).

Backward: the gate backward writes each branch's copy g_x * do and also its softmax row term
delta_x = g_x * dg_x (it sums o_x * do for dg_x anyway), so no branch runs its own delta pass. With
`gate_in_branches` (a memory saving for training at long context, at some time) no copy is written:
each branch's kernels take do and g_x and apply the gate themselves, ds = g_x * p * (dp - dg_x). The
three branches' dq are summed with one rounding and no pass of their own: the window's dq kernel writes
float32, the selected branch's atomics add to that, and the compression's dq kernel, launched last,
adds the sum in its epilogue. Each branch's copy of the output gradient is freed once that branch is
done. Once differentiable (no double backward).

The window branch depends on no other branch, so on a GPU its forward (once the compression forward is
queued) and its backward run on a second CUDA stream, beside the selection's top-k and selected walks,
which leave the tensor cores idle (they wait on L2 reads, atomics and reductions). The streams join
before the op returns.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from nsa_eval.kernels._triton_utils import contiguous, default_scale, interpreting
from nsa_eval.kernels.band import band_backward_dkv, band_backward_dq, band_forward
from nsa_eval.kernels.gates import gate_backward, gate_forward
from nsa_eval.kernels.importance import select_blocks
from nsa_eval.kernels.selection import by_block, selected_backward, selected_forward, selected_forward_gated

# Key rows (B x T x Hkv) up to which the selected walk writes the gated sum in its epilogue: there its
# wait for the window's output costs less than the pass that reads o_slc back (G = 16 at 8k: 2.30 ms
# against 2.35, 16k 5.21-5.24 against 5.30-5.35), past it more (32k 12.55-12.88 against 12.46-12.64,
# 64k 32.70-33.30 against 32.31-32.90). The forward per key block writes it in its merge at any length.
GATE_IN_WALK_MAX_ROWS = 16384 * 4


@functools.cache
def _second_stream(device: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def _side_stream(x: torch.Tensor, window_stream: bool | None) -> torch.cuda.Stream | None:
    """The second stream of x's device (None on the CPU, under the interpreter, or with
    `window_stream=False`), made to wait for the work queued so far on the current stream."""
    if window_stream is False or not x.is_cuda or interpreting():
        return None
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    side = _second_stream(device)
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


def writes_gated_sum(G: int, kv_rows: int, per_block: bool | None = None) -> bool:
    """Whether the selected forward writes NSA's gated output, for a group of G query heads over
    `kv_rows` = B x T x Hkv key rows: where it runs per key block (`per_block`, by default
    `selection.by_block`), and in the walk up to `GATE_IN_WALK_MAX_ROWS`."""
    per_block = by_block(G, kv_rows) if per_block is None else per_block
    return per_block or kv_rows <= GATE_IN_WALK_MAX_ROWS


class NSAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, params, needs_grad, paths):
        # needs_grad: a backward may follow (grad mode on, an input requiring a gradient; inside
        # forward grad mode is always off, and ctx.needs_input_grad ignores torch.no_grad)
        block_len, stride, select_size, num_selected, num_init, num_local, window, scale = params
        _, window_stream, per_block, gated_sum_in_selected = paths
        q, k, v, k_cmp, v_cmp, k_swa, v_swa = contiguous(q, k, v, k_cmp, v_cmp, k_swa, v_swa)
        G, kv_rows = q.shape[2] // k.shape[2], k.shape[0] * k.shape[1] * k.shape[2]
        per_block = by_block(G, kv_rows) if per_block is None else per_block
        gate_in = (writes_gated_sum(G, kv_rows, per_block) if gated_sum_in_selected is None
                   else gated_sum_in_selected)
        o_cmp, lse_cmp = band_forward(q, k_cmp, v_cmp, scale=scale, key_stride=stride,
                                      key_offset=block_len - 1)
        # the window after the compression forward, beside the selection
        side = _side_stream(q, window_stream)
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
                                                       before_sum=lambda: _join(side, o_swa, lse_swa),
                                                       per_block=per_block)
        else:
            o_slc, lse_slc = selected_forward(q, k, v, bi, select_size=select_size, scale=scale,
                                              presorted=True, per_block=per_block)
            _join(side, o_swa, lse_swa)
            o = gate_forward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)
        ctx.save_for_backward(q, k, v, k_cmp, v_cmp, k_swa, v_swa, g_cmp, g_slc, g_swa, bi,
                              o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa)
        ctx.params = params
        ctx.paths = paths
        ctx.mark_non_differentiable(bi)
        ctx.set_materialize_grads(False)  # no zeros for the block indices' gradient
        return o, bi

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dbi):
        (q, k, v, k_cmp, v_cmp, k_swa, v_swa, g_cmp, g_slc, g_swa, bi,
         o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa) = ctx.saved_tensors
        block_len, stride, select_size, _, _, _, window, scale = ctx.params
        in_branches, window_stream, _, _ = ctx.paths
        do = do.contiguous()
        d_o, d_g, delta = gate_backward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, do,
                                        scaled_do=not in_branches)
        if in_branches:  # every branch reads do itself and applies its gate
            d_o = [do] * 3
        gates = [g_cmp, g_slc, g_swa] if in_branches else [None] * 3
        band = dict(scale=scale, key_stride=stride, key_offset=block_len - 1, gate=gates[0])
        window_band = dict(scale=scale, key_stride=1, key_offset=0, window=window, gate=gates[2])
        side = _side_stream(q, window_stream)  # the window beside the selected branch
        do_swa = d_o.pop(2)  # held until the streams join: the side stream reads it
        with torch.cuda.stream(side):  # no-op for None
            # the window's dq in float32: the accumulator the selected backward adds to
            dq_swa = band_backward_dq(q, k_swa, v_swa, lse_swa, do_swa, delta[2], **window_band,
                                      dtype=torch.float32)
            swa_dq_done = torch.cuda.Event() if side is not None else None
            if swa_dq_done is not None:
                swa_dq_done.record(side)
            dk_swa, dv_swa = band_backward_dkv(q, k_swa, v_swa, lse_swa, do_swa, delta[2], **window_band)
        if side is None:
            del do_swa
        do_cmp, do_slc = d_o
        del d_o  # each branch's do_x is dropped as soon as that branch is done
        # the selected atomics wait for the window's dq: the compression's dk/dv go first
        dk_cmp, dv_cmp = band_backward_dkv(q, k_cmp, v_cmp, lse_cmp, do_cmp, delta[0], **band,
                                           split_heads=True)
        if swa_dq_done is not None:
            torch.cuda.current_stream(q.device).wait_event(swa_dq_done)
            dq_swa.record_stream(torch.cuda.current_stream(q.device))
        dq_slc, dk, dv = selected_backward(q, k, v, bi, o_slc, lse_slc, do_slc, select_size=select_size,
                                           scale=scale, delta=delta[1], dq_float32=True, gate=gates[1],
                                           presorted=True, dq_into=dq_swa)
        del do_slc
        _join(side, dq_swa, dk_swa, dv_swa)
        # the compression's dq kernel goes last and adds the other branches' dq (dq_slc holds both)
        dq = band_backward_dq(q, k_cmp, v_cmp, lse_cmp, do_cmp, delta[0], **band, add=dq_slc)
        return (dq, dk, dv, dk_cmp, dv_cmp, *d_g, dk_swa, dv_swa, None, None, None)


def nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, k_swa=None, v_swa=None, block_len=32,
                  stride=16, select_size=64, num_selected=16, num_init=1, num_local=2, window=512, scale=None,
                  gate_in_branches=False, return_block_indices=False, window_stream=None,
                  selected_per_block=None, gated_sum_in_selected=None):
    """NSA prefill/training, `g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa`, through the Triton
    kernels (inputs already validated; see `nsa_eval.kernels.nsa_attention`).

    q `[B, T, Hq, Dk]`; k, v (and k_swa, v_swa, default k, v) `[B, T, Hkv, Dk/Dv]`; k_cmp, v_cmp
    `[B, Tc, Hkv, Dk/Dv]`; gates `[B, T, Hq]`. Returns o `[B, T, Hq, Dv]` (and the int32
    `[B, T, Hkv, num_selected]` block indices if asked). `gate_in_branches`: the backward applies each
    branch's gate inside its kernels instead of writing three gated copies of the output gradient
    (less memory, more time).

    `window_stream`, `selected_per_block`, `gated_sum_in_selected` (None: by device and shape) choose
    the implementation, not the result: the window on a second CUDA stream, the selected forward per
    key block (`selection.by_block`), NSA's gated sum from the selected forward's last launch
    (`writes_gated_sum`). Tests pass them to cover a path the inputs at hand would not take.
    """
    k_swa = k if k_swa is None else k_swa
    v_swa = v if v_swa is None else v_swa
    scale = default_scale(scale, q.shape[-1])
    params = (block_len, stride, select_size, num_selected, num_init, num_local, window, scale)
    paths = (gate_in_branches, window_stream, selected_per_block, gated_sum_in_selected)
    inputs = (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    o, bi = NSAFunction.apply(*inputs, params, needs_grad, paths)
    return (o, bi) if return_block_indices else o

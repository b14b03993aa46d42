"""The gated sum of NSA's three branches in Triton, `g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa`:
the forward pass (where the selected forward does not write it, `prefill.writes_gated_sum`) and the
backward, which also gives each branch's softmax row term.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import cdiv, launcher, pow2


@triton.jit
def _gate_fwd_kernel(OC, OS, OW, GC, GS, GW, O, N, DV: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr):
    # all contiguous: branch outputs / O [N, DV], gates [N]
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    cols = tl.arange(0, BDV)
    m_r = rows < N
    mask = m_r[:, None] & (cols < DV)[None, :]
    offs = rows[:, None] * DV + cols[None, :]
    gc = tl.load(GC + rows, mask=m_r, other=0.0).to(tl.float32)
    gs = tl.load(GS + rows, mask=m_r, other=0.0).to(tl.float32)
    gw = tl.load(GW + rows, mask=m_r, other=0.0).to(tl.float32)
    o = gc[:, None] * tl.load(OC + offs, mask=mask, other=0.0).to(tl.float32)
    o += gs[:, None] * tl.load(OS + offs, mask=mask, other=0.0).to(tl.float32)
    o += gw[:, None] * tl.load(OW + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + offs, o.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_kernel(OC, OS, OW, GC, GS, GW, DO, DOC, DOS, DOW, DGC, DGS, DGW, DELTA, N, DV: tl.constexpr,
                     BDV: tl.constexpr, BR: tl.constexpr, SCALED_DO: tl.constexpr):
    # d o_x = g_x * do, d g_x = rowsum(o_x * do); everything contiguous as in the forward. Also each
    # branch's softmax-backward row term, float32 DELTA [3, N] (cmp, slc, swa), so that the branches
    # need no delta pass of their own: rowsum(o_x * d o_x) = g_x * d g_x with SCALED_DO, else (no d o_x
    # written: the branches' kernels apply g_x themselves) d g_x in float32
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR]
    cols = tl.arange(0, BDV)
    m_r = rows < N
    mask = m_r[:, None] & (cols < DV)[None, :]
    offs = rows[:, None] * DV + cols[None, :]
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)  # [BR, BDV]
    gc = tl.load(GC + rows, mask=m_r, other=0.0).to(tl.float32)
    gs = tl.load(GS + rows, mask=m_r, other=0.0).to(tl.float32)
    gw = tl.load(GW + rows, mask=m_r, other=0.0).to(tl.float32)
    if SCALED_DO:
        tl.store(DOC + offs, (gc[:, None] * do).to(DOC.dtype.element_ty), mask=mask)
        tl.store(DOS + offs, (gs[:, None] * do).to(DOS.dtype.element_ty), mask=mask)
        tl.store(DOW + offs, (gw[:, None] * do).to(DOW.dtype.element_ty), mask=mask)
    dgc = tl.sum(tl.load(OC + offs, mask=mask, other=0.0).to(tl.float32) * do, 1)  # [BR]
    tl.store(DGC + rows, dgc.to(DGC.dtype.element_ty), mask=m_r)
    dgs = tl.sum(tl.load(OS + offs, mask=mask, other=0.0).to(tl.float32) * do, 1)
    tl.store(DGS + rows, dgs.to(DGS.dtype.element_ty), mask=m_r)
    dgw = tl.sum(tl.load(OW + offs, mask=mask, other=0.0).to(tl.float32) * do, 1)
    tl.store(DGW + rows, dgw.to(DGW.dtype.element_ty), mask=m_r)
    if SCALED_DO:
        dgc, dgs, dgw = gc * dgc, gs * dgs, gw * dgw
    tl.store(DELTA + rows, dgc, mask=m_r)
    tl.store(DELTA + N + rows, dgs, mask=m_r)
    tl.store(DELTA + 2 * N + rows, dgw, mask=m_r)


def _gate_rows(dv: int) -> int:
    return max(1, min(64, 4096 // pow2(dv)))


def gate_forward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa):
    """`g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa` (contiguous inputs), no autograd."""
    dv = o_cmp.shape[-1]
    n = o_cmp.numel() // max(dv, 1)
    o = torch.empty_like(o_cmp)
    if n:
        BR = _gate_rows(dv)
        launcher(_gate_fwd_kernel)[(cdiv(n, BR),)](o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, o, n, DV=dv,
                                                   BDV=pow2(dv), BR=BR, num_warps=4)
    return o


def gate_backward(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, do, *, scaled_do=True):
    """Backward of the gated sum (contiguous inputs; o_x, do `[B, T, Hq, Dv]`, g_x `[B, T, Hq]`):
    ([do_cmp, do_slc, do_swa], [dg_cmp, dg_slc, dg_swa], delta), with delta float32 `[3, B, T, Hq]`,
    each branch's rowsum(o_x * do_x). `scaled_do=False`: no do_x = g_x * do is written (None in its
    place) and delta is each branch's rowsum(o_x * do), for kernels that take do and g_x
    (`band_backward(gate=...)`, `selected_backward(gate=...)`)."""
    do = do.contiguous()
    dv = o_cmp.shape[-1]
    n = o_cmp.numel() // max(dv, 1)
    d_o = [torch.empty_like(x) if scaled_do else do for x in (o_cmp, o_slc, o_swa)]
    d_g = [torch.empty_like(g) for g in (g_cmp, g_slc, g_swa)]
    delta = torch.empty(3, *g_cmp.shape, device=do.device, dtype=torch.float32)
    if n:
        BR = _gate_rows(dv)
        launcher(_gate_bwd_kernel)[(cdiv(n, BR),)](
            o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, do, *d_o, *d_g, delta, n, DV=dv, BDV=pow2(dv), BR=BR,
            SCALED_DO=scaled_do, num_warps=4)
    return (d_o if scaled_do else [None] * 3), d_g, delta

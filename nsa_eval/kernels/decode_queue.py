"""The Triton NSA decode in one launch (`decode.DECODE_VARIANT = "queue"`).

The fused decode runs four dependent launches (compressed keys -> importances and top-k -> selected
blocks -> merge); each waits for the whole of the one before, with a launch's ramp and tail between
them, so at 64k and batch 16 the last three take ~31 us for ~50 MB. Here the same work items run in
one grid, ordered by a ticket each program takes from an atomic counter when it starts, and each
item waits (spinning on an acquire load of a per-row counter) only for the items of its own
(sequence, KV head) row that it needs. A program waits only for items with earlier tickets, which
programs that already started hold, so the wait always ends (no assumption on the order in which
the hardware starts programs).

Tickets come in groups of one row's items: group g holds row g's compressed splits and window
chunks, then row g - `QUEUE_LAG`'s importance programs (the last of which takes the row's top-k),
selected-block programs and merge programs. So while the compressed splits of later rows stream
the caches, the rows begun `QUEUE_LAG` groups earlier select and attend, and only the last rows'
chain after their compressed pass is left at the end.

Per row, the counters (int32, zeroed before the launch): compressed splits done, importance programs
arrived, top-k done, selected programs done, window chunks done. Items read what other programs of
the launch wrote with L2 loads (`.cg`): an SM's L1 is not coherent with the others' stores.

The items themselves are the fused decode's (`decode.py`): `_cmp_split`, `_window_partial`,
`_tile_importance` with `_last_takes_topk`, `_selected_slot`, `_merge_partials`. Geometries where
the per-tile importance sums do not apply (`decode.tile_layout` is None) run the fused decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels import decode, topk
from nsa_eval.kernels._triton_utils import LOG2E, interpreting, pow2, softmax_start
from nsa_eval.kernels.decode import (
    _cmp_split,
    _decode_fused,
    _last_takes_topk,
    _load_q,
    _merge_partials,
    _program_rows,
    _selected_slot,
    _step2_topk,
    _store_partial,
    _tile_importance,
    _window_partial,
    tile_layout,
)

# compressed-key splits per row (at most 32: the merge loads a branch's partials at once). Smaller
# splits finish early rows sooner, so their later items overlap the other rows' compressed pass.
QUEUE_SPLITS = 16
# groups between a row's compressed splits and its importance, selected and merge items
QUEUE_LAG = 8
QUEUE_WARPS = 4
# programs per SM that loop over tickets (persistent), or None: one program per ticket
QUEUE_PERSISTENT = None
# output columns per merge item: DVC (a few items per row) or all of them (one item per row)
QUEUE_MERGE_ONE = False
# timing probes only: items of the kinds after the first QUEUE_KINDS (compressed, window, importance,
# selected, merge) do nothing
QUEUE_KINDS = 5
# tiles of 64 compressed keys per importance program (as decode.IMP_TILES_PER_PROGRAM)
QUEUE_IMP_TILES = 32


@triton.jit
def _wait_for(CNT, target):
    # spin until the counter at CNT reaches target; acquire: the loads after it see what the
    # programs that counted wrote before their release
    n = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
    while n < target:
        n = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")


@triton.jit
def _arrive(CNT):
    tl.debug_barrier()  # every thread's stores before the release
    tl.atomic_add(CNT, 1, sem="release", scope="gpu")


@triton.jit
def _decode_queue_kernel(
    Q, K, V, KC, VC, KW, VW, LENS, TI, TS, TM, PM, PL, PO, IMP, BI, SCR, CNT, GC, GS, GW, O,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
    skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
    TC, S, HKV, G, BH, NCMP, NWP, NIMP, NSELP, NMERGE, LAG, NPART, NTILES, NS,
    block_len, stride, select_size, num_selected, num_init, num_local, window, scale_log2,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BC: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, JT: tl.constexpr,
    JW: tl.constexpr, NSP: tl.constexpr, NSPP: tl.constexpr, CT: tl.constexpr, SPP: tl.constexpr,
    NPB: tl.constexpr, DVC: tl.constexpr, BNS_ALL: tl.constexpr, NSEL2: tl.constexpr,
    TOPK_KIND: tl.constexpr, CAP: tl.constexpr, MAP_BF16: tl.constexpr, CMP_STAGES: tl.constexpr,
    SEL_STAGES: tl.constexpr, MERGE_CHUNKS: tl.constexpr, PERSISTENT: tl.constexpr, KINDS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # CNT int32 [1 + 5 * BH]: the ticket, then per row the counters of the module docstring.
    # Partials per row as in the fused decode: NCMP compression, NSELP selection, NWP window.
    # PERSISTENT: each program takes tickets until none is left; else one ticket per program.
    # KINDS < 5 (timing probes only): items of the kinds after the first KINDS of (compressed split,
    # window, importance, selected, merge) do nothing.
    per = NCMP + NWP + NIMP + NSELP + NMERGE
    total = (BH + LAG) * per
    cmp_done = CNT + 1
    imp_arrived = cmp_done + BH
    topk_done = imp_arrived + BH
    sel_done = topk_done + BH
    win_done = sel_done + BH
    item = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")
    if PERSISTENT:
        while item < total:
            _queue_item(Q, K, V, KC, VC, KW, VW, LENS, TI, TS, TM, PM, PL, PO, IMP, BI, SCR, GC, GS, GW, O,
                        cmp_done, imp_arrived, topk_done, sel_done, win_done, item // per, item % per,
                        sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skc_b, skc_t, skc_h, svc_b, svc_t,
                        svc_h, skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
                        TC, S, HKV, G, BH, NCMP, NWP, NIMP, NSELP, LAG, NPART, NTILES, NS,
                        block_len, stride, select_size, num_selected, num_init, num_local, window, scale_log2,
                        DK, DV, BDK, BDV, M, BC, BS, BW, WT, JT, JW, NSP, NSPP, CT, SPP, NPB, DVC, BNS_ALL,
                        NSEL2, TOPK_KIND, CAP, MAP_BF16, CMP_STAGES, SEL_STAGES, MERGE_CHUNKS, KINDS, UPCAST)
            item = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")
    else:  # a loop around the item would cost registers (194 against 168 at the benchmark's shape)
        _queue_item(Q, K, V, KC, VC, KW, VW, LENS, TI, TS, TM, PM, PL, PO, IMP, BI, SCR, GC, GS, GW, O,
                    cmp_done, imp_arrived, topk_done, sel_done, win_done, item // per, item % per,
                    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
                    skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
                    TC, S, HKV, G, BH, NCMP, NWP, NIMP, NSELP, LAG, NPART, NTILES, NS,
                    block_len, stride, select_size, num_selected, num_init, num_local, window, scale_log2,
                    DK, DV, BDK, BDV, M, BC, BS, BW, WT, JT, JW, NSP, NSPP, CT, SPP, NPB, DVC, BNS_ALL, NSEL2,
                    TOPK_KIND, CAP, MAP_BF16, CMP_STAGES, SEL_STAGES, MERGE_CHUNKS, KINDS, UPCAST)


@triton.jit
def _queue_item(Q, K, V, KC, VC, KW, VW, LENS, TI, TS, TM, PM, PL, PO, IMP, BI, SCR, GC, GS, GW, O,
                cmp_done, imp_arrived, topk_done, sel_done, win_done, group, k,
                sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
                skw_b, skw_t, skw_h, svw_b, svw_t, svw_h,
                TC, S, HKV, G, BH, NCMP, NWP, NIMP, NSELP, LAG, NPART, NTILES, NS,
                block_len, stride, select_size, num_selected, num_init, num_local, window, scale_log2,
                DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
                BC: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr, WT: tl.constexpr, JT: tl.constexpr,
                JW: tl.constexpr, NSP: tl.constexpr, NSPP: tl.constexpr, CT: tl.constexpr, SPP: tl.constexpr,
                NPB: tl.constexpr, DVC: tl.constexpr, BNS_ALL: tl.constexpr, NSEL2: tl.constexpr,
                TOPK_KIND: tl.constexpr, CAP: tl.constexpr, MAP_BF16: tl.constexpr, CMP_STAGES: tl.constexpr,
                SEL_STAGES: tl.constexpr, MERGE_CHUNKS: tl.constexpr, KINDS: tl.constexpr,
                UPCAST: tl.constexpr):
    # item k of group `group` (module docstring): row `group` for compressed splits and window chunks,
    # row `group - LAG` for the rest
    row = tl.where(k < NCMP + NWP, group, group - LAG)
    if (row >= 0) & (row < BH):
        i_b, i_hk, t, o_r, o_dk, o_dv = _program_rows(LENS, row, HKV, BDK, BDV, M)
        if k < NCMP:
            _cmp_split(Q, KC, VC, TI, TI, TS, TM, PM, PL, PO, k, row, i_b, i_hk, t, sq_b, sq_h, skc_b,
                       skc_t, skc_h, svc_b, svc_t, svc_h, TC, G, NCMP, NPART, 0, NTILES, scale_log2,
                       block_len, stride, select_size, o_r, o_dk, o_dv, DK, DV, M, BDV, BC, True, JT, JW, NSP,
                       MAP_BF16, UPCAST, CMP_STAGES)
            _arrive(cmp_done + row)
        elif k < NCMP + NWP:
            if KINDS < 2:
                return
            q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
            m_i, l_i, acc = _window_partial(q, KW, VW, i_b, i_hk, t, S, window, k - NCMP, skw_b, skw_t, skw_h,
                                            svw_b, svw_t, svw_h, o_r, o_dk, o_dv, G, scale_log2, DK, DV, M,
                                            BDV, BW, WT, UPCAST)
            part = row * NPART + NSELP + k  # window chunk k - NCMP, after the NCMP + NSELP others
            _store_partial(PM, PL, PO, part, m_i, l_i, acc, o_r, o_dv, M, BDV)
            _arrive(win_done + row)
        elif k < NCMP + NWP + NIMP:
            if KINDS < 3:
                return
            _wait_for(cmp_done + row, NCMP)
            _tile_importance(LENS, TI, TS, TM, PM, PL, IMP, k - NCMP - NWP, row, TC, HKV, NPART, BC, NTILES,
                             NS, block_len, stride, select_size, NCMP, M, NPB, CT, JT, NSP, NSPP, ".cg")
            if _last_takes_topk(IMP, BI, imp_arrived, SCR, row, t, NS, select_size, num_selected, num_init,
                                num_local, NIMP, BNS_ALL, NSEL2, TOPK_KIND, CAP):
                _arrive(topk_done + row)
        elif k < NCMP + NWP + NIMP + NSELP:
            if KINDS < 4:
                return
            _wait_for(topk_done + row, 1)
            i_p = k - (NCMP + NWP + NIMP)
            q = _load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
            m_i, l_i, acc = softmax_start(M, BDV)
            for j in tl.range(0, SPP, num_stages=SEL_STAGES):
                m_i, l_i, acc = _selected_slot(q, K, V, BI, row, i_p * SPP + j, i_b, i_hk, t, S, m_i, l_i,
                                               acc, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk, o_dv, G,
                                               scale_log2, num_selected, DK, DV, BS, UPCAST, ".cg")
            _store_partial(PM, PL, PO, row * NPART + NCMP + i_p, m_i, l_i, acc, o_r, o_dv, M, BDV)
            _arrive(sel_done + row)
        else:
            if KINDS < 5:
                return
            _wait_for(sel_done + row, NSELP)
            _wait_for(win_done + row, NWP)
            _merge_partials(PM, PL, PO, GC, GS, GW, O, i_b, i_hk, row * NPART,
                            (k - (NCMP + NWP + NIMP + NSELP)) * MERGE_CHUNKS, HKV, G, NSELP, NWP, NCMP, o_r,
                            DV, M, BDV, NPB, DVC, MERGE_CHUNKS)


def decode_queue(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, lens, *, block_len, stride,
                 select_size, num_selected, num_init, num_local, window, scale):
    """The decode in one launch; arguments and result as `decode._decode_fused` (o `[B, 1, Hq, Dv]`,
    block indices int32 `[B * Hkv, num_selected]`)."""
    interp = interpreting()
    BC = 16 if interp else decode.CMP_TILE_KEYS
    layout = tile_layout(BC, block_len, stride, select_size)
    if layout is None:
        return _decode_fused(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, lens,
                             block_len=block_len, stride=stride, select_size=select_size,
                             num_selected=num_selected, num_init=num_init, num_local=num_local, window=window,
                             scale=scale)
    jt, nsp = layout
    B, _, HQ, DK = q.shape
    S, HKV = k.shape[1], k.shape[2]
    TC, DV = k_cmp.shape[1], v.shape[3]
    G = HQ // HKV
    BH = B * HKV
    M, BDK, BDV = pow2(G), pow2(DK), pow2(DV)
    f32 = dict(device=q.device, dtype=torch.float32)

    n_tiles = max(1, triton.cdiv(TC, BC))
    n_cmp = min(n_tiles, 32, QUEUE_SPLITS)
    SPP = decode.SEL_PER_PROGRAM
    BW, WT = (16, 2) if interp else (64, decode.WIN_TILES_PER_PROGRAM)
    n_selp = max(1, triton.cdiv(num_selected, SPP))
    n_winp = max(1, triton.cdiv(window, WT * BW))
    npart = n_cmp + n_selp + n_winp
    ns = triton.cdiv(S, select_size)
    ct = pow2(QUEUE_IMP_TILES, 1)
    n_imp = triton.cdiv(triton.cdiv(ns, jt), ct)
    npb = pow2(max(n_cmp, n_selp, n_winp), 1)
    dvc = min(BDV, max(4, 1024 * QUEUE_WARPS // (npb * M)))
    merge_chunks = BDV // dvc if QUEUE_MERGE_ONE else 1
    n_merge = BDV // dvc // merge_chunks
    nsel2 = pow2(num_selected, 2)
    bns_all = max(pow2(ns), nsel2)
    topk_kind = _step2_topk(bns_all, nsel2)

    tile_sums = torch.empty(BH, n_tiles, M, jt, **f32)
    tile_spill = torch.empty(BH, n_tiles, M, max(nsp, 1), **f32)
    tile_max = torch.empty(BH, n_tiles, M, **f32)
    pm = torch.empty(BH, npart, M, **f32)
    pl = torch.empty(BH, npart, M, **f32)
    po = torch.empty(BH, npart, M, BDV, **f32)
    imp = torch.empty(BH, ns, **f32)
    bi = torch.empty(BH, num_selected, device=q.device, dtype=torch.int32)
    scratch = torch.empty(BH if topk_kind.startswith("filter") else 1, topk.TOPK_FILTER_CAP, device=q.device,
                          dtype=torch.int64)
    counters = torch.zeros(1 + 5 * BH, device=q.device, dtype=torch.int32)
    o = torch.empty(B, 1, HQ, DV, device=q.device, dtype=q.dtype)
    per = n_cmp + n_winp + n_imp + n_selp + n_merge
    grid = (BH + QUEUE_LAG) * per
    if QUEUE_PERSISTENT:  # under the interpreter as if on 2 SMs (programs run one after another)
        sms = 2 if interp else decode._num_sms(q.device.index or 0)
        grid = min(grid, QUEUE_PERSISTENT * sms)
    _decode_queue_kernel[(grid,)](
        q, k, v, k_cmp, v_cmp, k_swa, v_swa, lens, tile_sums, tile_spill, tile_max, pm, pl, po, imp, bi,
        scratch, counters, g_cmp, g_slc, g_swa, o,
        q.stride(0), q.stride(2), *k.stride()[:3], *v.stride()[:3], *k_cmp.stride()[:3], *v_cmp.stride()[:3],
        *k_swa.stride()[:3], *v_swa.stride()[:3],
        TC, S, HKV, G, BH, n_cmp, n_winp, n_imp, n_selp, n_merge, QUEUE_LAG, npart, n_tiles, ns,
        block_len, stride, select_size, num_selected, num_init, num_local, window, scale * LOG2E,
        DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M, BC=BC, BS=select_size, BW=BW, WT=WT, JT=jt, JW=pow2(jt + nsp),
        NSP=nsp, NSPP=pow2(nsp, 1), CT=ct, SPP=SPP, NPB=npb, DVC=dvc, BNS_ALL=bns_all, NSEL2=nsel2,
        TOPK_KIND=topk_kind, CAP=topk.TOPK_FILTER_CAP,
        MAP_BF16=decode.TILE_MAP == "bf16x2" and min(block_len, select_size) <= 256 and not interp,
        CMP_STAGES=decode.CMP_STAGES, SEL_STAGES=max(decode.SEL_STAGES, 1), MERGE_CHUNKS=merge_chunks,
        PERSISTENT=bool(QUEUE_PERSISTENT), KINDS=QUEUE_KINDS, UPCAST=interp,
        num_warps=QUEUE_WARPS, num_stages=1,
    )
    return o, bi

"""Triton NSA decode: one new query per sequence against caches of raw and compressed keys/values.

The work is split over the blocks actually read (split-K), so the cost grows with the number of
blocks, not with the cache size. Four launches, each program holding all G query heads of a KV head's
group as rows:
1. the compressed keys, in splits: a partial softmax per split, and per tile the probabilities mapped
   onto the selection blocks (`decode_scoring._decode_cmp_kernel`);
2. the selection blocks' importances, the top-k by the last program of each row to finish, and the
   window's chunks beside them (`decode_scoring._decode_importance_kernel`);
3. `_decode_selected_kernel`, one program per `SEL_PER_PROGRAM` selected-block slots: a partial
   softmax over those blocks;
4. `_decode_merge_kernel`, one program per (DVC output columns, sequence x KV head): the partials of
   the three branches merged (one load of all partials of each branch, then its merge weights from
   one load of its (max, sum) rows, gates folded in) and the output written.
The number of compression splits fills the GPU (about `CMP_PROGRAMS_PER_SM` programs per SM, at most
32), so each (sequence, KV head) has a few partials instead of one per 64 keys. The launches read the
query positions from `cache_seqlens` on the device and reset their counters themselves, so they
replay from a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nsa_eval.kernels import topk
from nsa_eval.kernels._triton_utils import (
    LOG2E,
    cdiv,
    default_scale,
    interpreting,
    launcher,
    pow2,
    softmax_start,
)
from nsa_eval.kernels.decode_scoring import (
    decode_cmp_kernel,
    decode_importance_kernel,
    load_q,
    merge_softmax,
    partial_softmax,
    program_rows,
    store_partial,
    tile_layout,
)

# Launch constants, measured at the benchmark's decode (B = 16, 64/4 heads, d = 128, bf16, 64k cache,
# CUDA graph):
# compressed-key programs per SM the splits aim at (B * Hkv * splits ~ this * SMs); keys per tile of
# step 1 (16 under the interpreter); its stages and warps: 4 warps 71.9 us for step 1, 2 warps 75.9,
# 8 warps 74.2
CMP_PROGRAMS_PER_SM = 2
CMP_TILE_KEYS = 64
CMP_STAGES = 3
CMP_WARPS = 4
# selected-block slots per program of step 3, window tiles of 64 keys per program of step 2: 4 and 2
# against 2 and 1, 114.0 us against 117.1 for the whole decode
SEL_PER_PROGRAM = 4
WIN_TILES_PER_PROGRAM = 2
# step 3's loop over a program's selected blocks, software-pipelined over this many stages (the next
# blocks' loads in flight during this block's math): 74.1 us at 3 stages against 74.9 at 2 and 75.4
# unrolled (39.3 / 39.8 / 40.6 at 8k); warps of steps 3 and 4 (8 past 256 partial rows)
SEL_STAGES = 3
ATTN_WARPS = 4
# chunks of selection blocks (32 blocks each with the paper's sizes) per program of step 2 when it maps
# the stored scores: 2 unrolled chunks 111.8 us against 115.0 for 4 and 128.6 for 1
IMP_CHUNKS_PER_PROGRAM = 2
# tiles of compressed keys (JT = 16 selection blocks each with the paper's sizes) per program of step
# 2 from step 1's per-tile sums: 32 tiles 78.0 us, 16 tiles 79.6-80.3, 8 tiles 83.1 (from the stored
# scores: 104.0)
IMP_TILES_PER_PROGRAM = 32
# launch of step 2: 164 registers at 4 warps (3 programs per SM) and 110.6 us; maxnreg=128 (4 programs,
# 188 bytes spilled) 115.2, 2 warps 115.5, 8 warps 144.4: it is not short of programs per SM
IMP_LAUNCH = dict(num_warps=4)


@triton.jit
def _selected_slot(q, K, V, BI, i_bh, slot, i_b, i_hk, t, S, m_i, l_i, acc, sk_b, sk_t, sk_h, sv_b, sv_t,
                   sv_h, o_r, o_dk, o_dv, G, scale_log2, num_selected, DK: tl.constexpr, DV: tl.constexpr,
                   BS: tl.constexpr, UPCAST: tl.constexpr):
    # the running softmax (m_i, l_i, acc) merged with the block in selection slot `slot` (none for -1)
    blk = tl.load(BI + i_bh * num_selected + slot, mask=slot < num_selected, other=-1)
    o_k = tl.maximum(blk, 0) * BS + tl.arange(0, BS)
    m_k = (o_k <= t) & (o_k < S) & (tl.zeros([BS], tl.int32) + blk >= 0)
    _, m, l, o = partial_softmax(q, K, V, i_b, i_hk, o_k, m_k, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk,
                                 o_dv, G, scale_log2, DK, DV, UPCAST)
    return merge_softmax(m_i, l_i, acc, m, l, o)


@triton.jit
def _decode_selected_kernel(
    Q, K, V, LENS, BI, PM, PL, PO,
    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    S, HKV, G, NCMP, NPART, scale_log2, num_selected,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr,
    BS: tl.constexpr, SPP: tl.constexpr, SEL_STAGES: tl.constexpr, UPCAST: tl.constexpr,
):
    # Step 3, one program per SPP selected-block slots (sequence x KV head): a partial softmax, stored
    # after step 1's NCMP partials of its row. BI [B*HKV, num_selected] from step 2.
    i_p = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b, i_hk, t, o_r, o_dk, o_dv = program_rows(LENS, i_bh, HKV, BDK, BDV, M)
    q = load_q(Q, i_b, i_hk, G, sq_b, sq_h, o_r, o_dk, DK, UPCAST)
    m_i, l_i, acc = softmax_start(M, BDV)
    for j in tl.range(0, SPP, num_stages=SEL_STAGES):  # the next blocks' loads in flight
        m_i, l_i, acc = _selected_slot(q, K, V, BI, i_bh, i_p * SPP + j, i_b, i_hk, t, S, m_i, l_i, acc,
                                       sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, o_r, o_dk, o_dv, G, scale_log2,
                                       num_selected, DK, DV, BS, UPCAST)
    store_partial(PM, PL, PO, i_bh * NPART + NCMP + i_p, m_i, l_i, acc, o_r, o_dv, M, BDV)


@triton.jit
def _decode_merge_kernel(
    PM, PL, PO, GC, GS, GW, O, HKV, G, NSELP, NWP, NCMP, NPART,
    DV: tl.constexpr, BDV: tl.constexpr, M: tl.constexpr, NPB: tl.constexpr, DVC: tl.constexpr,
):
    # Step 4, one program per (chunk of DVC output columns, sequence x KV head): the partials of the
    # three branches (at the row's base: NCMP compression, then NSELP selection, then NWP window; absent
    # ones empty) merged, with the gates folded into the merge weights; gates and output O contiguous
    # [B, 1, HQ(, DV)]. No load waits for another: the partials load before the weights' reductions.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b, i_hk, base = (i_bh // HKV).to(tl.int64), i_bh % HKV, i_bh * NPART
    o_r = tl.arange(0, M)
    f_slc = base + NCMP
    f_swa = f_slc + NSELP
    head = (i_b * HKV + i_hk) * G + o_r  # [M] flat (b, h) since HQ = HKV * G
    m_r = o_r < G
    o_dc = i_c * DVC + tl.arange(0, DVC)
    a_cmp = _branch_partials(PO, base, NCMP, o_r, o_dc, M, BDV, NPB)  # [NPB, M, DVC]
    a_slc = _branch_partials(PO, f_slc, NSELP, o_r, o_dc, M, BDV, NPB)
    a_swa = _branch_partials(PO, f_swa, NWP, o_r, o_dc, M, BDV, NPB)
    w_cmp = _branch_weights(PM, PL, base, NCMP, o_r, M, NPB)  # [NPB, M]
    w_cmp *= tl.load(GC + head, mask=m_r, other=0.0).to(tl.float32)[None, :]
    w_slc = _branch_weights(PM, PL, f_slc, NSELP, o_r, M, NPB)
    w_slc *= tl.load(GS + head, mask=m_r, other=0.0).to(tl.float32)[None, :]
    w_swa = _branch_weights(PM, PL, f_swa, NWP, o_r, M, NPB)
    w_swa *= tl.load(GW + head, mask=m_r, other=0.0).to(tl.float32)[None, :]
    out = tl.sum(w_cmp[:, :, None] * a_cmp + w_slc[:, :, None] * a_slc + w_swa[:, :, None] * a_swa, 0)
    tl.store(O + head[:, None].to(tl.int64) * DV + o_dc[None, :], out.to(O.dtype.element_ty),
             mask=m_r[:, None] & (o_dc < DV)[None, :])


@triton.jit
def _branch_weights(PM, PL, first, n, o_r, M: tl.constexpr, NPB: tl.constexpr):
    # softmax-merge weights [NPB, M] of the n partials first .. first + n - 1 (0 for absent ones), the
    # 1 / sum included. Loads .cg (L2): the partials were written by other programs.
    o_p = tl.arange(0, NPB)
    m_p = (o_p < n)[:, None]
    offs = (first + o_p[:, None]) * M + o_r[None, :]  # [NPB, M]
    m = tl.load(PM + offs, mask=m_p, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(PL + offs, mask=m_p, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 0)  # [M]
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe[None, :])  # [NPB, M]
    l_sum = tl.sum(l * w, 0)  # [M]
    return w / tl.where(l_sum > 0, l_sum, 1.0)[None, :]


@triton.jit
def _branch_partials(PO, first, n, o_r, o_dc, M: tl.constexpr, BDV: tl.constexpr, NPB: tl.constexpr):
    # columns o_dc [DVC] of the n partials first .. first + n - 1 -> [NPB, M, DVC] (0 for absent ones)
    o_p = tl.arange(0, NPB)
    return tl.load(PO + ((first + o_p[:, None, None]) * M + o_r[None, :, None]) * BDV + o_dc[None, None, :],
                   mask=(o_p < n)[:, None, None], other=0.0, cache_modifier=".cg")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, cache_seqlens=None, k_swa=None, v_swa=None,
               block_len=32, stride=16, select_size=64, num_selected=16, num_init=1, num_local=2,
               window=512, scale=None, return_block_indices=False):
    """NSA for one new query per sequence (same result as the last row of prefill).

    Args:
        q: new queries `[B, 1, Hq, Dk]`.
        k, v: caches of the selection branch `[B, S, Hkv, Dk]`, `[B, S, Hkv, Dv]` (new token included).
        k_cmp, v_cmp: compressed caches `[B, Sc, Hkv, Dk]`, `[B, Sc, Hkv, Dv]`.
        g_cmp, g_slc, g_swa: gates `[B, 1, Hq]`.
        cache_seqlens: int `[B]` valid tokens incl. the new one (default S); the query sits at
            `cache_seqlens - 1`.
        k_swa, v_swa: window caches `[B, W, Hkv, Dk]`, `[B, W, Hkv, Dv]`, default k, v: position p sits
            in row p % W, so W = S is a cache laid out like k, v and W >= window a ring of the last W.

    Returns:
        o `[B, 1, Hq, Dv]`; with `return_block_indices` also int32 `[B, 1, Hkv, num_selected]`.
    """
    B, _, HQ, DK = q.shape
    S = k.shape[1]
    if select_size < 16 or select_size & (select_size - 1):
        raise ValueError(f"the Triton nsa_decode needs select_size a power of two >= 16, got {select_size}")
    ratio = select_size // stride
    if select_size % stride or ratio & (ratio - 1):
        raise ValueError(f"the Triton nsa_decode needs select_size a power-of-two multiple of stride, "
                         f"got select_size={select_size}, stride={stride}")
    k_swa = k if k_swa is None else k_swa
    v_swa = v if v_swa is None else v_swa
    if cache_seqlens is None:
        lens = torch.full((B,), S, dtype=torch.int32, device=q.device)
    elif cache_seqlens.dtype in (torch.int32, torch.int64):
        lens = cache_seqlens.contiguous()
    else:
        lens = cache_seqlens.to(torch.int32)
    for x in (k, v, k_cmp, v_cmp, k_swa, v_swa):
        if x.stride(-1) != 1:
            raise ValueError("nsa_decode needs caches with a contiguous last dimension")
    params = dict(block_len=block_len, stride=stride, select_size=select_size, num_selected=num_selected,
                  num_init=num_init, num_local=num_local, window=window, scale=default_scale(scale, DK))
    o, bi, _ = decode_steps(q.contiguous(), k, v, k_cmp, v_cmp, g_cmp.contiguous(), g_slc.contiguous(),
                            g_swa.contiguous(), k_swa, v_swa, lens, **params)  # [B, 1, Hq, Dv], [B*Hkv, n]
    if return_block_indices:
        return o, bi.view(B, 1, k.shape[2], num_selected)
    return o


def decode_steps(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, k_swa, v_swa, lens, *, block_len, stride,
                 select_size, num_selected, num_init, num_local, window, scale):
    """The four launches of `nsa_decode` (q and gates contiguous, caches with a contiguous last dim,
    lens int32/int64 [B]) -> (o [B, 1, Hq, Dv], block indices int32 [B*Hkv, n], and step 2's
    importances float32 [B*Hkv, Ns], written up to each row's own block)."""
    B, _, HQ, DK = q.shape
    S, HKV = k.shape[1], k.shape[2]
    TC, DV = k_cmp.shape[1], v.shape[3]
    G = HQ // HKV
    BH = B * HKV
    M = pow2(G)
    BDK, BDV = pow2(DK), pow2(DV)
    interp = interpreting()
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    dev_index = dev.index if dev.index is not None else (0 if interp else torch.cuda.current_device())

    # splits of the compressed keys: about CMP_PROGRAMS_PER_SM programs per SM in all
    BC = 16 if interp else CMP_TILE_KEYS
    n_tiles = max(1, cdiv(TC, BC))
    if interp:
        n_cmp = cdiv(n_tiles, 2)
    else:
        # at most 32 splits: the final merge loads all partials of a branch at once
        n_cmp = min(n_tiles, 32, max(1, CMP_PROGRAMS_PER_SM * _num_sms(dev_index) // BH))
    sc_len = n_tiles * BC
    ratio = select_size // stride
    layout = tile_layout(BC, block_len, stride, select_size)  # None: step 2 maps the stored scores
    tile_imp = layout is not None
    jt, nsp = layout if tile_imp else (0, 0)
    # step 3's programs take SPP selected-block slots; step 2's window programs WT tiles of BW keys
    SPP = SEL_PER_PROGRAM
    BW, WT = (16, 2) if interp else (64, WIN_TILES_PER_PROGRAM)
    n_selp = max(1, cdiv(num_selected, SPP))
    n_winp = max(1, cdiv(window, WT * BW))
    npart = n_cmp + n_selp + n_winp

    if tile_imp:
        scores = torch.empty(1, **f32)
        tile_sums = torch.empty(BH, n_tiles, M, jt, **f32)
        tile_spill = torch.empty(BH, n_tiles, M, max(nsp, 1), **f32)
        tile_max = torch.empty(BH, n_tiles, M, **f32)
    else:
        scores = torch.empty(BH, M, sc_len, **f32)
        tile_sums = tile_spill = tile_max = torch.empty(1, **f32)
    pm = torch.empty(BH, npart, M, **f32)
    pl = torch.empty(BH, npart, M, **f32)
    po = torch.empty(BH, npart, M, BDV, **f32)
    counter = torch.empty(BH, device=dev, dtype=torch.int32)  # zeroed by step 1
    scale_log2 = scale * LOG2E

    # 1. compression branch: scores or per-tile block sums, and one partial softmax per split. The
    # tile map runs as two bfloat16 MMAs (the probabilities' bfloat16 part and its remainder, ~2^-17
    # relative error, against token counts exact in bfloat16 up to 256): step 1 at 64k 38 us against
    # 44 in three tf32 passes; under the interpreter one float32 product
    launcher(decode_cmp_kernel)[(n_cmp, BH)](
        q, k_cmp, v_cmp, lens, scores, tile_sums, tile_spill, tile_max, pm, pl, po, counter,
        q.stride(0), q.stride(2), *k_cmp.stride()[:3], *v_cmp.stride()[:3], TC, HKV, G, n_cmp, npart, sc_len,
        n_tiles, scale_log2, block_len, stride, select_size, DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M, BC=BC,
        TILE_IMP=tile_imp, JT=jt, JW=pow2(jt + nsp), NSP=nsp,
        MAP_BF16=min(block_len, select_size) <= 256 and not interp, UPCAST=interp,
        num_warps=CMP_WARPS, num_stages=CMP_STAGES,
    )

    # 2. selection-block importances, the top-k by the last program of each row, the window's chunks
    ns = cdiv(S, select_size)
    imp = torch.empty(BH, ns, **f32)
    bns = 16 if interp else max(16, 128 // ratio)
    spill = pow2(max(1, cdiv(block_len, stride) - 1))
    npb = pow2(max(n_cmp, n_selp, n_winp), 1)
    bi = torch.empty(BH, num_selected, device=dev, dtype=torch.int32)
    nsel2 = pow2(num_selected, 2)  # >= 2 for tl.topk
    bns_all = max(pow2(ns), nsel2)
    lean = topk.lean_fits(bns_all, nsel2)
    scratch = topk.lean_scratch(BH if lean else 1, dev)
    # several importance programs a row under the interpreter too, as on a GPU's long caches
    ct = 2 if interp else pow2(IMP_TILES_PER_PROGRAM, 1)
    if tile_imp:
        n_imp = cdiv(cdiv(ns, jt), ct)
    else:
        n_imp = cdiv(ns, bns * IMP_CHUNKS_PER_PROGRAM)
    launcher(decode_importance_kernel)[(n_imp + n_winp, BH)](
        lens, scores, tile_sums, tile_spill, tile_max, pm, pl, imp, bi, counter, scratch, q, k_swa, v_swa,
        po,
        q.stride(0), q.stride(2), *k_swa.stride()[:3], *v_swa.stride()[:3], TC, HKV, G, npart, BC, sc_len,
        n_tiles, ns, block_len, stride, select_size, num_selected, num_init, num_local, n_imp, n_cmp, n_selp,
        k_swa.shape[1], window, scale_log2, M=M, BNS=bns, RATIO=ratio, SPILL=spill, NPB=npb,
        BNS_ALL=bns_all, NSEL2=nsel2, DK=DK, DV=DV, BDK=BDK, BDV=BDV, BW=BW, WT=WT,
        CPP=IMP_CHUNKS_PER_PROGRAM, TILE_IMP=tile_imp, CT=ct, JT=max(jt, 1), NSP=nsp, NSPP=pow2(nsp, 1),
        LEAN=lean, CAP=topk.TOPK_CAP, UPCAST=interp, **({} if interp else IMP_LAUNCH),
    )

    # 3. the selected blocks
    o = torch.empty(B, 1, HQ, DV, device=dev, dtype=q.dtype)
    # the final merge loads [npb, M, DVC] partials per branch at once: about 2048 values per 4 warps
    warps = ATTN_WARPS if npb * M <= 256 else 8
    dvc = min(BDV, max(4, 512 * warps // (npb * M)))
    launcher(_decode_selected_kernel)[(n_selp, BH)](
        q, k, v, lens, bi, pm, pl, po, q.stride(0), q.stride(2), *k.stride()[:3], *v.stride()[:3],
        S, HKV, G, n_cmp, npart, scale_log2, num_selected, DK=DK, DV=DV, BDK=BDK, BDV=BDV, M=M,
        BS=select_size, SPP=SPP, SEL_STAGES=SEL_STAGES, UPCAST=interp, num_warps=warps,
    )
    # 4. the merge, one program per (chunk of output columns, row)
    launcher(_decode_merge_kernel)[(BDV // dvc, BH)](
        pm, pl, po, g_cmp, g_slc, g_swa, o, HKV, G, n_selp, n_winp, n_cmp, npart, DV=DV, BDV=BDV, M=M,
        NPB=npb, DVC=dvc, num_warps=warps,
    )
    return o, bi, imp

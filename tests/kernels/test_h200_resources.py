"""Shared memory of the launch configurations, compiled ahead of time for the H200 (sm_90).

A launch can compile in bf16 and not in float32 (the compression dk/dv in 128-key tiles needs 262,656
bytes of shared memory in float32, the limit is 232,448), which a GPU shows only when that dtype runs.
These tests compile the kernels the way they launch, for both dtypes, without a GPU (Triton's NVIDIA
backend and its bundled ptxas), in a fresh process: the interpreter, which other kernel tests use,
leaves triton.language patched.
"""

from __future__ import annotations

import torch

from nsa_eval.kernels import _validate
from tests.kernels.sm90 import H200_SHARED_LIMIT, json_from_fresh_python

COMPILE = r"""
import json
import torch
from nsa_eval.kernels import _triton_utils as u, band, importance as imp, selection as s
from tests.kernels.sm90 import shared_bytes as shared


def desc(name, rows, cols):
    # the type of a TMA tensor descriptor (`_triton_utils.tma_descriptor`) with blocks [1, rows, 1, cols]
    return f"tensordesc<{name}[1,{rows},1,{cols}]>"


def prefill(name, dtype, D, DV=None, gated=(False,)):
    # the prefill's kernels at Dk = D, Dv = DV (default D) as they launch them, TMA copies where they
    # take them (`band.BAND_TMA`; the selected forward wherever it can; not with a split head dim),
    # the backward's also with the gates applied in them (`gate_in_branches`) where `gated` says:
    # {kernel, dtype and dims: bytes}
    DV = DV or D
    (BD, BD2), BDV = u.dk_tiles(D), u.pow2(DV)  # a split head dim: two MMAs
    out = {}
    p = "*" + name
    for branch, in_branches in ((branch, g) for branch in ("cmp", "swa") for g in gated):
        window = None if branch == "cmp" else 512
        tag = " gated" if in_branches else ""
        tma = band._tma(window, "dkv") and not BD2
        cfg = band._band_config(window, "dkv", dtype, D, DV)
        consts = dict(HAS_WINDOW=branch == "swa", DK=D, DV=DV, BDK=BD, BDK2=BD2, BDV=BDV, BM=cfg.pop("BM"),
                      BN=cfg.pop("BN"), UPCAST=False, SPLIT_MASK=band._split_mask(window, "dkv"),
                      GATED=in_branches, TMA=tma)
        q_do = [desc(name, consts["BM"], BD), desc(name, consts["BM"], BDV)] if tma else [p, p]
        pointers = [q_do[0], p, p, q_do[1]] + ["*fp32"] * 2 + [p] + ["*fp32"] * 2
        out[f"band dkv {branch}{tag} {name}"] = shared(band._band_bwd_dkv_kernel, pointers, consts, cfg)
        tma = band._tma(window, "dq") and not BD2
        cfg = band._band_config(window, "dq", dtype, D, DV)
        # the compression's dq adds the other branches' (float32); the window's writes float32
        consts = dict(consts, BM=cfg.pop("BM"), BN=cfg.pop("BN"), SPLIT_MASK=band._split_mask(window, "dq"),
                      TMA=tma, HAS_ADD=branch == "cmp")
        kv = [desc(name, consts["BN"], BD), desc(name, consts["BN"], BDV)] if tma else [p, p]
        pointers = [p, *kv, p] + ["*fp32"] * 2 + [p, p if branch == "cmp" else "*fp32", "*fp32"]
        out[f"band dq {branch}{tag} {name}"] = shared(band._band_bwd_dq_kernel, pointers, consts, cfg)
    for branch in ("cmp", "swa"):
        window = None if branch == "cmp" else 512
        tma = band._tma(window, "fwd") and not BD2
        cfg = band._band_config(window, "fwd", dtype, D, DV, tma=tma)
        consts = dict(HAS_WINDOW=branch == "swa", DK=D, DV=DV, BDK=BD, BDK2=BD2, BDV=BDV, BM=cfg.pop("BM"),
                      BN=cfg.pop("BN"), UPCAST=False, SPLIT_MASK=band._split_mask(window, "fwd"), TMA=tma)
        kv = [desc(name, consts["BN"], BD), desc(name, consts["BN"], BDV)] if tma else [p, p]
        out[f"band fwd {branch} {name}"] = shared(band._band_fwd_kernel, [p, *kv, p, "*fp32"], consts, cfg)
    for GP in (16, 4, 1):  # fewer heads: more positions a program
        launch = imp.importance_launch(GP, dtype, D)
        rows = launch.pop("rows")
        consts = dict(DK=D, BDK=BD, BDK2=BD2, GP=GP, BT=rows // GP, BNS=imp.CHUNK_BLOCKS, RATIO=4, K=1,
                      UPCAST=False, LANES=True, block_len=32, stride=16, select_size=64)
        out[f"importance G'={GP} {name}"] = shared(imp._importance_kernel, [p, p, "*fp32", "*fp32"], consts,
                                                   launch)
    GP = 16
    tma = not BD2
    # as the prefill runs it at G = 16: the walk writes NSA's gated sum (`prefill.writes_gated_sum`)
    # on short inputs and only its own output on long ones
    consts = dict(DK=D, DV=DV, BDK=BD, BDK2=BD2, BDV=BDV, GP=GP, BT=1, BS=64, NP=16, UPCAST=False, TMA=tma,
                  GATE_SUM=False, STORE_O=True, PACKED=False)
    kv = [desc(name, 64, BD), desc(name, 64, BDV)] if tma else [p, p]
    selected = [p, *kv, "*i32", p, "*fp32"] + [p] * 6
    fwd = s._selected_fwd_kernel
    out[f"selected fwd {name}"] = shared(fwd, selected, consts, s.selected_fwd_launch(1, D, tma))
    out[f"selected fwd gated sum {name}"] = shared(fwd, selected, dict(consts, GATE_SUM=True),
                                                   s.selected_fwd_launch(1, D, tma))
    consts = dict(consts, GP=4, BT=4, PACKED=True)  # G = 4: four positions a program
    out[f"selected fwd G=4 {name}"] = shared(fwd, selected, consts, s.selected_fwd_launch(4, D, tma))
    config = s.selected_dkv_launch(dtype, D, DV)
    BQ = max(1, config.pop("rows") // GP)
    BK, BK2 = s.dkv_column_tiles(D, config.pop("split_dk"))
    for in_branches in gated:
        consts = dict(DK=D, DV=DV, BDK=BK, BDK2=BK2, BDV=BDV, GP=GP, BQ=BQ, BS=64, UPCAST=False,
                      GATED=in_branches, PRELOAD=BQ * 64)  # as selected_backward launches it
        pointers = [p] * 4 + ["*fp32"] * 2 + [p] + ["*i32"] * 4 + ["*fp32"] * 3
        tag = " gated" if in_branches else ""
        out[f"selected dkv{tag} {name}"] = shared(s._selected_dkv_kernel, pointers, consts, config)
    return {f"{key} d={D}/{DV}": size for key, size in out.items()}


def decode(name, D):
    # the decode's four launches at Dk = Dv = D, as `decode.decode_steps` launches them at the
    # benchmark's decode: 64 query heads over 4 KV heads (16 rows a program), a 64k cache, batch 16
    import triton
    from nsa_eval.kernels import decode as dec, decode_scoring as sc, topk

    M, RATIO, NS = 16, 4, 1024  # rows (G = 16), l' / d, selection blocks at 64k
    b, f, i = "*" + name, "*fp32", "*i32"
    n_cmp = 4  # compressed-key splits on a 132-SM H200 at batch 16 (CMP_PROGRAMS_PER_SM = 2)
    n_selp, n_winp = triton.cdiv(16, dec.SEL_PER_PROGRAM), triton.cdiv(512, 64 * dec.WIN_TILES_PER_PROGRAM)
    npb = u.pow2(max(n_cmp, n_selp, n_winp), 1)
    warps = dec.ATTN_WARPS if npb * M <= 256 else 8
    dvc = min(D, max(4, 512 * warps // (npb * M)))
    common = dict(DK=D, DV=D, BDK=D, BDV=D, M=M, UPCAST=False)
    jt, nsp = sc.tile_layout(dec.CMP_TILE_KEYS, 32, 16, 64)  # the paper's sizes spill into 1 more block
    launches = [
        ("1 compressed keys", sc.decode_cmp_kernel, [b, b, b, i] + [f] * 7 + [i],
         dict(common, BC=dec.CMP_TILE_KEYS, TILE_IMP=True, JT=jt, JW=u.pow2(jt + nsp), NSP=nsp,
              MAP_BF16=True),
         dict(num_warps=dec.CMP_WARPS, num_stages=dec.CMP_STAGES)),
        ("2 importance + top-k + window", sc.decode_importance_kernel,
         [i] + [f] * 7 + [i, i, i, b, b, b, f],
         dict(common, BNS=max(16, 128 // RATIO), RATIO=RATIO, SPILL=1, NPB=npb, BNS_ALL=NS, NSEL2=16, BW=64,
              WT=dec.WIN_TILES_PER_PROGRAM, CPP=dec.IMP_CHUNKS_PER_PROGRAM, TILE_IMP=True,
              CT=u.pow2(dec.IMP_TILES_PER_PROGRAM, 1), JT=jt, NSP=nsp, NSPP=u.pow2(nsp, 1),
              LEAN=topk.lean_fits(NS, 16), CAP=topk.TOPK_CAP),
         dict(dec.IMP_LAUNCH)),
        ("3 selected blocks", dec._decode_selected_kernel, [b] * 3 + [i, i, f, f, f],
         dict(common, BS=64, SPP=dec.SEL_PER_PROGRAM, SEL_STAGES=dec.SEL_STAGES), dict(num_warps=warps)),
        ("4 merge", dec._decode_merge_kernel, [f, f, f, b, b, b, b],
         dict(DV=D, BDV=D, M=M, NPB=npb, DVC=dvc), dict(num_warps=warps)),
    ]
    return {f"decode {launch} {name} d={D}": shared(kernel, pointers, consts, options)
            for launch, kernel, pointers, consts, options in launches}


def others(name):
    # the kernels the calls above leave out, as they launch at the benchmark's shapes (G = 4 where the
    # forward runs per key block): the top-k (lean filter, and the arg-max passes alone), the forward
    # per key block, its merge and its index, the gated sum and its backward, the row delta
    from nsa_eval.kernels import gates, selected_by_block as sb, topk

    b, f, i = "*" + name, "*fp32", "*i32"
    launches = []
    for lean in (True, False):
        launch = dict(num_warps=topk.TOPK_WARPS, **({"maxnreg": topk.TOPK_LEAN_MAXNREG} if lean else {}))
        launches.append((f"topk lean={lean}", topk._topk_blocks_kernel, [f, i, i, i],
                         dict(HAS_POS=False, BR=1, BNS=1024, NSEL=16, LEAN=lean, CAP=topk.TOPK_CAP), launch))
    BQ = sb.BY_BLOCK_ROWS // 4
    launches += [
        ("by block", sb._by_block_kernel, [b, b, b] + [i] * 5 + [b, f],
         dict(DK=128, DV=128, BDK=128, BDK2=0, BDV=128, GP=4, BQ=BQ, BS=64, UPCAST=False,
              PRELOAD=BQ * sb.BY_BLOCK_CHUNK_STEPS), sb.BY_BLOCK_CONFIG),
        ("by block merge", sb._merge_kernel, [i, b, f, b, f] + [b] * 6,
         dict(DV=128, BDV=128, GP=4, NP=16, BS=64, GATE_SUM=True, STORE_O=True), sb.MERGE_CONFIG),
        ("index count", sb._count_kernel, [i] * 9,
         dict(BS=64, SPREAD=sb.INDEX_SPREAD, BLOCK=sb.INDEX_BLOCK, SCAN_BLOCK=512), {}),
        ("index scatter", sb._scatter_kernel, [i] * 8, dict(SPREAD=sb.INDEX_SPREAD, BLOCK=sb.INDEX_BLOCK),
         {}),
        ("gated sum", gates._gate_fwd_kernel, [b] * 7, dict(DV=128, BDV=128, BR=gates._gate_rows(128)),
         dict(num_warps=4)),
        ("gated sum backward", gates._gate_bwd_kernel, [b] * 13 + [f],
         dict(DV=128, BDV=128, BR=gates._gate_rows(128), SCALED_DO=True), dict(num_warps=4)),
        ("row delta", u._delta_kernel, [b, b, f, f], dict(DV=128, BDV=128, BR=16, HAS_DLSE=True), {}),
    ]
    return {f"{launch} {name}": shared(kernel, pointers, consts, options)
            for launch, kernel, pointers, consts, options in launches}


print(json.dumps(__CALLS__))
"""


def test_default_launches_fit_h200_shared_memory():
    """G = 16, d = 128, the paper's blocks: the banded forwards, dq and dk/dv (also with the gates
    applied in them, `gate_in_branches`), the importance kernel (also at G' = 4 and 1, whose programs
    hold more positions), the selected
    forward (G = 16, with and without NSA's gated sum in its epilogue, and G = 4) and dk/dv (also
    gated), each as it launches, fit in bf16 and float32."""
    calls = ('prefill("bf16", torch.bfloat16, 128, gated=(False, True)) | '
             'prefill("fp32", torch.float32, 128, gated=(False, True))')
    shared = json_from_fresh_python(COMPILE.replace("__CALLS__", calls))
    assert len(shared) == 36
    too_big = {k: v for k, v in shared.items() if v > H200_SHARED_LIMIT}
    assert not too_big, f"over the H200's {H200_SHARED_LIMIT} bytes of shared memory: {too_big}"


def test_widest_head_dims_fit_h200_shared_memory():
    """The largest head dims the Triton kernels take (`_validate.TRITON_MAX_HEAD_DIM`): the prefill's
    kernels and the fused decode's four launches at Dk = Dv = 256 in bf16 (smaller launches,
    `wide_rows`), the prefill's at the paper's Dk = 192, Dv = 128 in bf16 (split in two column tiles,
    `dk_tiles`, on the launches of dims past 128: `_band_config`, `importance_launch`,
    `selected_fwd_launch`), and the
    decode's at 128 in float32 (the prefill's: the test above). A float32 launch at 256 would need up
    to 460 KB."""
    assert _validate.TRITON_MAX_HEAD_DIM == {torch.float16: 256, torch.bfloat16: 256, torch.float32: 128}
    calls = ('prefill("bf16", torch.bfloat16, 256) | decode("bf16", 256) | decode("fp32", 128) | '
             'prefill("bf16", torch.bfloat16, 192, 128)')
    shared = json_from_fresh_python(COMPILE.replace("__CALLS__", calls))
    assert len(shared) == 34
    too_big = {k: v for k, v in shared.items() if v > H200_SHARED_LIMIT}
    assert not too_big, f"over the H200's {H200_SHARED_LIMIT} bytes of shared memory: {too_big}"


def test_other_kernels_compile_for_h200():
    """The kernels the tests above leave out (the top-k with and without its lean filter, the forward
    per key block with its merge and its counting index, the gated sum and its backward, the row delta)
    compile for sm_90 as they launch, within the H200's shared memory: a Triton that cannot compile one
    (Triton 3.6 rejected a default string constexpr of a jit helper) fails here."""
    shared = json_from_fresh_python(COMPILE.replace("__CALLS__", 'others("bf16")'))
    assert len(shared) == 9
    too_big = {k: v for k, v in shared.items() if v > H200_SHARED_LIMIT}
    assert not too_big, f"over the H200's {H200_SHARED_LIMIT} bytes of shared memory: {too_big}"

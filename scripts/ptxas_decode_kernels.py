"""Registers, spills and shared memory of the fused decode's kernels compiled for the H200, no GPU needed.

    python scripts/ptxas_decode_kernels.py

Compiles the four launches of `decode.DECODE_VARIANT = "fused"` ahead of time for sm_90 at the
benchmark's decode (64 query heads over 4 KV heads, so 16 rows per program, d = 128, bf16, 64k
cache) with the module's current knobs, and prints what Triton's bundled ptxas reports. At 255
registers a kernel runs two 4-warp programs per SM at most, and spills go to local memory. Numbers
depend on the Triton version (the H200 image runs Triton 3.6): read them side by side, not as
absolutes. Run from the repository root.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must be unset before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from ptxas_band_kernels import compile_usage, is_divisible_scalar  # noqa: E402

from nsa_eval.kernels import _triton_utils as u  # noqa: E402
from nsa_eval.kernels import decode as dec  # noqa: E402
from nsa_eval.kernels import topk

M, D, RATIO, NS = 16, 128, 4, 1024  # rows (G = 16), head dim, l' / d, selection blocks at 64k
b, f, i = "*bf16", "*fp32", "*i32"


def launches():
    """(name, kernel, pointer types, constexprs, launch options) of each fused launch, as
    `decode._decode_fused` would launch them at the benchmark's shape."""
    n_cmp = 4  # compressed-key splits on a 132-SM H200 at batch 16 (CMP_PROGRAMS_PER_SM = 2)
    n_selp, n_winp = triton.cdiv(16, dec.SEL_PER_PROGRAM), triton.cdiv(512, 64 * dec.WIN_TILES_PER_PROGRAM)
    npb = u.pow2(max(n_cmp, n_selp, n_winp), 1)
    warps = dec.ATTN_WARPS if npb * M <= 256 else 8
    dvc = min(D, max(4, 512 * warps // (npb * M)))
    common = dict(DK=D, DV=D, BDK=D, BDV=D, M=M, UPCAST=False)
    tiles = dec.DECODE_IMPORTANCE == "tiles"
    jt = dec.CMP_TILE_KEYS // RATIO  # selection blocks per tile; the paper's sizes spill into 1 more
    return [
        ("1 compressed keys", dec._decode_cmp_split_kernel, [b, b, b, i] + [f] * 7 + [i, i, b, b],
         dict(common, BC=dec.CMP_TILE_KEYS, BW=64, WT=dec.WIN_TILES_PER_PROGRAM, WIN=dec.WINDOW_STEP == 1,
              TILE_IMP=tiles, JT=jt, JW=u.pow2(jt + 1), NSP=1, MAP_BF16=dec.TILE_MAP == "bf16x2"),
         dict(num_warps=dec.CMP_WARPS, num_stages=dec.CMP_STAGES)),
        ("2 importance + top-k + window", dec._decode_importance_split_kernel,
         [i] + [f] * 7 + [i, i, "*i64", b, b, b, f],
         dict(common, BNS=max(16, 128 // RATIO), RATIO=RATIO, SPILL=16, NPB=npb, BNS_ALL=NS, NSEL2=16, BW=64,
              WT=dec.WIN_TILES_PER_PROGRAM, CPP=dec.IMP_CHUNKS_PER_PROGRAM, TILE_IMP=tiles,
              CT=u.pow2(dec.IMP_TILES_PER_PROGRAM, 1), JT=jt, NSP=1, NSPP=1, TOPK=dec.TOPK_IN_STEP2,
              TOPK_KIND=dec._step2_topk(NS, 16), CAP=topk.TOPK_FILTER_CAP),
         dict(dec.IMP_LAUNCH)),
        ("3 selected blocks", dec._decode_attn_fused_kernel, [b] * 5 + [i, i, f, f, f, i, b, b, b, b],
         dict(common, BS=64, SPP=dec.SEL_PER_PROGRAM, BW=64, WT=dec.WIN_TILES_PER_PROGRAM, NPB=npb, DVC=dvc,
              MERGE=dec.MERGE_IN_ATTN, SEL_STAGES=dec.SEL_STAGES), dict(num_warps=warps)),
        ("4 merge", dec._decode_merge_kernel, [f, f, f, b, b, b, b],
         dict(DV=D, BDV=D, M=M, NPB=npb, DVC=dvc), dict(num_warps=warps)),
    ]


def main() -> int:
    print(f"triton {triton.__version__}; launch: registers, spill stores/loads (bytes), shared")
    for name, kernel, pointers, consts, options in launches():
        # pointers and strides are multiples of 16 at the benchmark's shape, and Triton specializes
        # on that at launch: without it, no load is 16 bytes wide and no loop is pipelined
        divisible = [i for i, arg in enumerate(kernel.arg_names) if arg not in consts
                     and (i < len(pointers) or is_divisible_scalar(arg))]
        regs, stores, loads, shared = compile_usage(kernel, pointers, consts, options, divisible)
        print(f"{name:30s}: {regs:3d} registers, spills {stores}/{loads}, shared {shared} ({options})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

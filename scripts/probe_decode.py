"""The fused decode's importance source and step 1's map, timed side by side (H200).

    PYTHONPATH=. python3 scripts/probe_decode.py

Batch 16, 64/4 heads, d = 128, bf16, full caches at 8k and 64k (the benchmark's decode shape):
CUDA-graph times of the fused decode with `DECODE_IMPORTANCE` "tiles" (the map in bf16x2 or tf32x3,
`TILE_MAP`) or "scores", a few program sizes of step 2 and of step 1; each output against the
defaults'. Then the kernels of the defaults, of the tf32x3 map and of the stored scores by device
time (plain launches).
"""

import torch

from nsa_eval.bench import PAPER, _time_graph, _with_flag, profile_kernels
from nsa_eval.kernels import decode

B, HQ, HKV, D = 16, 64, 4, 128
CONFIGS = [
    dict(),
    dict(TILE_MAP="tf32x3"),
    dict(DECODE_IMPORTANCE="scores"),
    dict(IMP_TILES_PER_PROGRAM=8),
    dict(IMP_TILES_PER_PROGRAM=32),
    dict(CMP_STAGES=2, CMP_PROGRAMS_PER_SM=3),
    dict(CMP_STAGES=4),
    dict(),
]


def with_knobs(knobs, fn):
    if not knobs:
        return fn()
    (name, value), rest = next(iter(knobs.items())), dict(list(knobs.items())[1:])
    return _with_flag(decode, name, value, lambda: with_knobs(rest, fn))


def inputs(T):
    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    gates = [torch.rand(B, 1, HQ, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return r(B, 1, HQ, D), r(B, T, HKV, D), r(B, T, HKV, D), r(B, tc, HKV, D), r(B, tc, HKV, D), gates


def probe(T):
    q, k, v, kc, vc, gates = inputs(T)
    lengths = torch.tensor([T - 97 * b for b in range(B)], device="cuda", dtype=torch.int32)

    def run():
        return decode.nsa_decode(q, k, v, kc, vc, *gates, cache_seqlens=lengths)

    want = run()
    for knobs in CONFIGS:
        got = with_knobs(knobs, run)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        us = with_knobs(knobs, lambda: _time_graph(run)) * 1e3
        print(f"T={T} {knobs or 'defaults'}: {us:.1f} us (CUDA graph), rel. err against defaults "
              f"{err:.1e}", flush=True)
    for knobs in (dict(), dict(TILE_MAP="tf32x3"), dict(DECODE_IMPORTANCE="scores")):
        print(f"kernels at T={T}, {knobs or 'defaults'} (plain launches):")
        with_knobs(knobs, lambda: profile_kernels(run, iters=20, top=5))


def main():
    for T in (8192, 65536):
        probe(T)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

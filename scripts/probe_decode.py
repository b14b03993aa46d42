"""Knobs of the fused decode timed side by side on one GPU (run 34 on the H200).

    PYTHONPATH=. python3 scripts/probe_decode.py

Batch 16, 64/4 heads, d = 128, bf16, caches at 8k and 64k (the benchmark's decode shape, lengths
T - 97 b): the CUDA-graph time of the fused decode under each setting in CONFIGS (keys name
`decode` attributes, or `_triton_utils.NAME`), each output against the defaults', the defaults
first and last (their spread is the noise); then the defaults' kernels by device time (plain
launches).
"""

import torch

from nsa_eval.bench import PAPER, _time_graph, _with_flag, profile_kernels
from nsa_eval.kernels import _triton_utils, decode

B, HQ, HKV, D = 16, 64, 4, 128
CONFIGS = [
    dict(),
    dict(CMP_WARPS=2),
    dict(CMP_WARPS=2, CMP_PROGRAMS_PER_SM=4),
    dict(CMP_WARPS=8),
    dict(CMP_PROGRAMS_PER_SM=3),
    {"_triton_utils.TOPK_METHOD": "bitonic"},
    dict(SEL_PER_PROGRAM=8, WIN_TILES_PER_PROGRAM=4),
    dict(SEL_PER_PROGRAM=8),
    dict(),
]


def with_knobs(knobs, fn):
    if not knobs:
        return fn()
    (name, value), rest = next(iter(knobs.items())), dict(list(knobs.items())[1:])
    module = _triton_utils if name.startswith("_triton_utils.") else decode
    return _with_flag(module, name.split(".")[-1], value, lambda: with_knobs(rest, fn))


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
    print(f"kernels at T={T}, defaults (plain launches):")
    profile_kernels(run, iters=20, top=6)


def main():
    for T in (8192, 65536):
        probe(T)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

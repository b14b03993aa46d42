"""Knobs of the fused decode timed side by side on one GPU (run 34 on the H200).

    PYTHONPATH=. python3 scripts/probe_decode.py [dims]

Batch 16, 64/4 heads, d = 128, bf16, caches at 8k and 64k (the benchmark's decode shape, lengths
T - 97 b): the CUDA-graph time of the fused decode under each setting in CONFIGS (keys name
`decode` attributes, or `topk.NAME`), each output against the defaults', the defaults
first and last (their spread is the noise); then the defaults' kernels by device time (plain
launches).

`dims` (run 52): the fused decode at 64k by head dims, 128 / 128, the paper's 192 / 128 (the decode
pads Dk to 256, unlike the prefill's kernels: masked columns are not read) and 256 / 256, beside
the bytes the paper's memory model says each must read.
"""

import sys

import torch

from nsa_eval.bench import PAPER, _time_graph, _with_flag, profile_kernels
from nsa_eval.kernels import decode, topk

B, HQ, HKV, D = 16, 64, 4, 128
CONFIGS = [
    dict(),
    dict(CMP_WARPS=2),
    dict(CMP_WARPS=2, CMP_PROGRAMS_PER_SM=4),
    dict(CMP_WARPS=8),
    dict(CMP_PROGRAMS_PER_SM=3),
    {"topk.TOPK_METHOD": "bitonic"},
    dict(SEL_PER_PROGRAM=8, WIN_TILES_PER_PROGRAM=4),
    dict(SEL_PER_PROGRAM=8),
    dict(),
]


def with_knobs(knobs, fn):
    if not knobs:
        return fn()
    (name, value), rest = next(iter(knobs.items())), dict(list(knobs.items())[1:])
    module = topk if name.startswith("topk.") else decode
    return _with_flag(module, name.split(".")[-1], value, lambda: with_knobs(rest, fn))


def inputs(T, dk=D, dv=D):
    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    gates = [torch.rand(B, 1, HQ, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return r(B, 1, HQ, dk), r(B, T, HKV, dk), r(B, T, HKV, dv), r(B, tc, HKV, dk), r(B, tc, HKV, dv), gates


def probe_dims(T):
    lengths = torch.tensor([T - 97 * b for b in range(B)], device="cuda", dtype=torch.int32)
    n_cmp = (lengths - PAPER["block_len"]) // PAPER["stride"] + 1
    tokens = n_cmp + PAPER["num_selected"] * PAPER["select_size"] + PAPER["window"]  # per (sequence, KV head)
    for dk, dv in ((128, 128), (192, 128), (256, 256)):
        q, k, v, kc, vc, gates = inputs(T, dk, dv)

        def run(q=q, k=k, v=v, kc=kc, vc=vc, gates=gates):
            return decode.nsa_decode(q, k, v, kc, vc, *gates, cache_seqlens=lengths)

        us = _time_graph(run) * 1e3
        mb = tokens.sum().item() * HKV * (dk + dv) * 2 / 1e6
        print(f"T={T} B={B} {HQ}/{HKV} Dk={dk} Dv={dv}: {us:.1f} us (CUDA graph), the paper's bytes "
              f"{mb:.0f} MB ({mb / us:.2f} TB/s)", flush=True)
        del q, k, v, kc, vc
        torch.cuda.empty_cache()


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
    if sys.argv[1:] == ["dims"]:
        probe_dims(65536)
        return
    for T in (8192, 65536):
        probe(T)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Knobs of the fused decode timed side by side on one GPU (run 34 on the H200).

    PYTHONPATH=. python3 scripts/probe_decode.py [dims | batches | launches | step2]

Batch 16, 64/4 heads, d = 128, bf16, caches at 8k and 64k (the benchmark's decode shape, lengths
T - 97 b): the CUDA-graph time of the fused decode under each setting in CONFIGS (keys name
`decode` attributes, or `topk.NAME`), each output against the defaults', the defaults
first and last (their spread is the noise); then the defaults' kernels by device time (plain
launches).

`batches` (run 61): the fused decode at 64k and batch 16, 32, 64 and 128 beside cuDNN's SDPA decode
over the full cache and the paper's bytes at the bandwidth of a read of the full caches, with the
decode's kernels at each batch (plain launches): how much of the decode is latency, not bytes.

`launches` (run 62): the fused decode at 64k, batch 64 and 16, under other launch shapes
(LAUNCH_CONFIGS).

`step2` (run 106): the fused decode at 64k and 8k with step 2's top-k by the lean filter
(`decode.STEP2_LEAN`, the default since) and by the filter, three rounds in alternation.

`dims` (run 52): the fused decode at 64k by head dims, 128 / 128, the paper's 192 / 128 (the decode
pads Dk to 256, unlike the prefill's kernels: masked columns are not read) and 256 / 256, beside
the bytes the paper's memory model says each must read.
"""

import sys

import torch

from nsa_eval.bench.kernels import PAPER, _time_graph, _with_flag, profile_kernels
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


def inputs(T, dk=D, dv=D, batch=B):
    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    gates = [torch.rand(batch, 1, HQ, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return (r(batch, 1, HQ, dk), r(batch, T, HKV, dk), r(batch, T, HKV, dv), r(batch, tc, HKV, dk),
            r(batch, tc, HKV, dv), gates)


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


def probe(T, batch=B, configs=CONFIGS):
    q, k, v, kc, vc, gates = inputs(T, batch=batch)
    lengths = torch.tensor([T - 97 * b for b in range(batch)], device="cuda", dtype=torch.int32)

    def run():
        return decode.nsa_decode(q, k, v, kc, vc, *gates, cache_seqlens=lengths)

    want = run()
    for knobs in configs:
        got = with_knobs(knobs, run)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        us = with_knobs(knobs, lambda: _time_graph(run)) * 1e3
        print(f"T={T} B={batch} {knobs or 'defaults'}: {us:.1f} us (CUDA graph), rel. err against defaults "
              f"{err:.1e}", flush=True)
    print(f"kernels at T={T}, B={batch}, defaults (plain launches):")
    profile_kernels(run, iters=20, top=6)


def time_batch(T, batch):
    """(NSA decode us, cuDNN SDPA decode us, decode_floor's dict) at cache length T, CUDA graphs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa_eval.bench.kernels import decode_floor

    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = r(batch, 1, HQ, D), r(batch, T, HKV, D), r(batch, T, HKV, D)
    kc, vc = r(batch, tc, HKV, D), r(batch, tc, HKV, D)
    gates = [torch.rand(batch, 1, HQ, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    lengths = torch.full((batch,), T, device="cuda", dtype=torch.int32)

    def nsa():
        return decode.nsa_decode(q, k, v, kc, vc, *gates, cache_seqlens=lengths)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  enable_gqa=True)

    us, us_cudnn = _time_graph(nsa) * 1e3, _time_graph(cudnn) * 1e3
    floor = decode_floor(T, batch, HQ, HKV, D, k, v)
    profile_kernels(nsa, iters=20, top=4)
    return us, us_cudnn, floor


def probe_batches(T=65536):
    for batch in (16, 32, 64, 128):
        us, us_cudnn, floor = time_batch(T, batch)
        floor_us = floor["floor_ms"] * 1e3
        print(f"T={T} B={batch}: NSA decode {us:.1f} us, cuDNN {us_cudnn:.1f} us: {us_cudnn / us:.2f}x; "
              f"floor {floor_us:.1f} us ({floor['nsa_bytes'] / 1e6:.0f} MB at {floor['hbm_tb_s']:.2f} TB/s), "
              f"NSA / floor {us / floor_us:.2f}, best ratio {us_cudnn / floor_us:.1f}x", flush=True)
        torch.cuda.empty_cache()


# `launches` (run 62): the launch shapes at batch 64 and 16 (the split count of step 1, the programs
# of steps 3 and 2, the merge's columns per program)
LAUNCH_CONFIGS = [
    dict(),
    *[{name: value} for name, values in (("CMP_PROGRAMS_PER_SM", (3, 4, 6)), ("SEL_PER_PROGRAM", (2, 8, 16)),
                                         ("WIN_TILES_PER_PROGRAM", (1, 4)), ("MERGE_COLUMNS", (16, 32, 128)),
                                         ("ATTN_WARPS", (8,)), ("IMP_TILES_PER_PROGRAM", (16,)))
      for value in values],
    dict(),
]

# run 106: step 2's top-k by the lean filter (the default since) against the filter, in alternation
STEP2_CONFIGS = [dict(), dict(STEP2_LEAN=False)] * 3


def main():
    if sys.argv[1:] == ["step2"]:
        for T in (65536, 8192):
            probe(T, B, STEP2_CONFIGS)
            torch.cuda.empty_cache()
        return
    if sys.argv[1:] == ["batches"]:
        probe_batches()
        return
    if sys.argv[1:] == ["launches"]:
        for batch in (64, 16):
            probe(65536, batch, LAUNCH_CONFIGS)
            torch.cuda.empty_cache()
        return
    if sys.argv[1:] == ["dims"]:
        probe_dims(65536)
        return
    for T in (8192, 65536):
        probe(T)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

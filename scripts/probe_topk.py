"""The prefill top-k alone, every method and launch shape, and the whole forward with the best ones (H200).

    PYTHONPATH=. python3 scripts/probe_topk.py [picks | lean]

Times `topk_blocks` on the importances of random inputs at 64k (64/4 and 16/4 heads), checks that
every method and launch gives the default's blocks, then the NSA forward at both group sizes with
the old default launch (4 rows over 4 warps) and one row per 1-warp program. Run 14's output is in
reports/kernels/topk_run14.log.

`picks` (run 54): how the filter picks among its candidates (`TOPK_FILTER_PICK`: by rank, or one
arg-max pass per pick), side by side, repeated in alternation: `topk_blocks` alone at 64k (same
blocks asserted), the decode at 8k and 64k (B = 16, CUDA graph; there the arg-max passes over the
whole row were the default before), and the NSA forward and forward+backward at 8k and 64k (64/4
and 16/4 heads).

`lean`: the lean filter (`TOPK_METHOD = "lean"`) at each register cap (`TOPK_LEAN_MAXNREG`) against
the filter, in alternation: `topk_blocks` alone on the importances of random inputs at 64k (64/4 and
16/4 heads) and 8k (same blocks asserted), then the NSA forward and forward+backward at 8k and 64k
(64/4 and 16/4 heads) with each method.
"""

import sys

import torch

from nsa_eval.bench.kernels import _inputs, _time, _time_graph, _with_flag, _with_flags, bench_nsa_prefill
from nsa_eval.kernels import importance, topk
from nsa_eval.kernels.compression import compressed_attention

T = 65536
LAUNCHES = ((4, 4), (1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 4))  # (rows, warps)


def topk_of_random_inputs(hq, length=T):
    """`topk_blocks` (a function of no arguments) on the importances of random inputs at `length`
    (64k by default), hq/4 heads."""
    x = _inputs(1, length, hq, 4, 128, grad=False)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        imp = importance.block_importance(x["q"], x["k_cmp"], lse, block_len=32, stride=16, select_size=64,
                                         scale=128 ** -0.5)
    return lambda: topk.topk_blocks(imp, T=length, num_kv_heads=4, select_size=64, num_selected=16,
                                    num_init=1, num_local=2)


def time_topk(hq):
    run_topk = topk_of_random_inputs(hq)
    want = run_topk()
    for method in topk.TOPK_METHODS:
        for rows, warps in LAUNCHES:
            def timed():
                return _time(run_topk), run_topk()

            try:
                ms, got = _with_flag(topk, "TOPK_METHOD", method, lambda: _with_flag(  # noqa: B023
                    topk, "TOPK_CONFIG", dict(rows=rows, num_warps=warps), timed))  # noqa: B023
                print(f"hq={hq} topk {method:8s} rows={rows} warps={warps}: {ms:.3f} ms, "
                      f"same={torch.equal(got, want)}", flush=True)
            except Exception as err:  # a launch may not compile
                print(f"hq={hq} topk {method} rows={rows} warps={warps} failed: {str(err).splitlines()[0]}")


def main():
    for hq in (64, 16):
        time_topk(hq)
        torch.cuda.empty_cache()
    for hq in (64, 16):
        for method, cfg in (("argmax", dict(rows=16, num_warps=4)), ("argmax", dict(rows=1, num_warps=1)),
                            ("bitonic", dict(rows=1, num_warps=1))):
            fwd, _ = _with_flag(topk, "TOPK_METHOD", method, lambda: _with_flag(  # noqa: B023
                topk, "TOPK_CONFIG", cfg, lambda: bench_nsa_prefill(T, hq, 4, 128)))  # noqa: B023
            print(f"prefill fwd hq={hq} {method} {cfg}: {fwd:.2f} ms", flush=True)


PICKS = {"rank": dict(TOPK_METHOD="filter", TOPK_FILTER_PICK="rank"),
         "argmax picks": dict(TOPK_METHOD="filter", TOPK_FILTER_PICK="argmax"),
         "argmax, whole row": dict(TOPK_METHOD="argmax")}


def _picks_topk_alone():
    run_topk = topk_of_random_inputs(64)
    want = run_topk()
    for rep in range(2):
        for name, flags in PICKS.items():
            ms, got = _with_flags(topk, flags, lambda: (_time(run_topk), run_topk()))  # noqa: B023
            print(f"[{rep}] topk_blocks 64k {name}: {ms:.3f} ms, same={torch.equal(got, want)}", flush=True)


def _picks_decode(length):
    from nsa_eval.kernels.decode import nsa_decode

    B, tc = 16, (length - 32) // 16 + 1
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = r(B, 1, 64, 128), r(B, length, 4, 128), r(B, length, 4, 128)
    kc, vc = r(B, tc, 4, 128), r(B, tc, 4, 128)
    gates = [torch.rand(B, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    seqlens = torch.full((B,), length, device="cuda", dtype=torch.int32)

    def decode():
        return nsa_decode(q, k, v, kc, vc, *gates, cache_seqlens=seqlens, return_block_indices=True)

    want = decode()
    for rep in range(3):
        for name, flags in PICKS.items():
            us = _with_flags(topk, flags, lambda: _time_graph(lambda: decode()[0])) * 1e3  # noqa: B023
            got = _with_flags(topk, flags, decode)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            print(f"[{rep}] decode T={length} B=16 {name}: {us:.1f} us (CUDA graph), same={same}", flush=True)


def picks():
    _picks_topk_alone()
    torch.cuda.empty_cache()
    for length in (8192, T):
        _picks_decode(length)
        torch.cuda.empty_cache()
    for length in (8192, T):
        for hq in (64, 16):
            for rep in range(2):
                for name, flags in list(PICKS.items())[:2]:
                    fwd, fb = _with_flags(topk, flags, lambda: bench_nsa_prefill(length, hq, 4, 128))  # noqa: B023
                    print(f"[{rep}] NSA T={length} {hq}/4 {name}: fwd {fwd:.3f} ms, fwd+bwd {fb:.3f} ms",
                          flush=True)
            torch.cuda.empty_cache()


LEAN = {"filter": dict(TOPK_METHOD="filter"),
        **{f"lean, maxnreg {cap}": dict(TOPK_METHOD="lean", TOPK_LEAN_MAXNREG=cap)
           for cap in (80, 72, 64, None)}}


def _lean_topk_alone(hq, length):
    run_topk = topk_of_random_inputs(hq, length)
    want = _with_flags(topk, LEAN["filter"], run_topk)
    for rep in range(3):
        for name, flags in LEAN.items():
            ms, got = _with_flags(topk, flags, lambda: (_time(run_topk), run_topk()))  # noqa: B023
            print(f"[{rep}] topk_blocks T={length} {hq}/4 {name}: {ms:.3f} ms, "
                  f"same={torch.equal(got, want)}", flush=True)


def lean():
    for hq, length in ((64, T), (16, T), (64, 8192)):
        _lean_topk_alone(hq, length)
        torch.cuda.empty_cache()
    for length in (8192, T):
        for hq in (64, 16):
            for rep in range(2):
                for name in ("filter", "lean, maxnreg 80"):
                    fwd, fb = _with_flags(topk, LEAN[name],
                                          lambda: bench_nsa_prefill(length, hq, 4, 128))  # noqa: B023
                    print(f"[{rep}] NSA T={length} {hq}/4 {name}: fwd {fwd:.3f} ms, fwd+bwd {fb:.3f} ms",
                          flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    modes = {"picks": picks, "lean": lean}
    modes[sys.argv[1]]() if sys.argv[1:] and sys.argv[1] in modes else main()

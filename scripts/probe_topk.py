"""The prefill top-k alone, every method and launch shape, and the whole forward with the best ones (H200).

    PYTHONPATH=. python3 scripts/probe_topk.py

Times `topk_blocks` on the importances of random inputs at 64k (64/4 and 16/4 heads), checks that
every method and launch gives the default's blocks, then the NSA forward at both group sizes with
the old default launch (4 rows over 4 warps) and one row per 1-warp program. Run 14's output is in
reports/kernels/topk_run14.log.
"""

import torch

from nsa_eval.bench import _inputs, _time, _with_flag, bench_nsa_prefill
from nsa_eval.kernels import _triton_utils as u
from nsa_eval.kernels import selection
from nsa_eval.kernels.compression import compressed_attention

T = 65536
LAUNCHES = ((4, 4), (1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 4))  # (rows, warps)


def time_topk(hq):
    x = _inputs(1, T, hq, 4, 128, grad=False)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        imp = selection.block_importance(x["q"], x["k_cmp"], lse, block_len=32, stride=16, select_size=64,
                                         scale=128 ** -0.5)

    def topk():
        return u.topk_blocks(imp, T=T, num_kv_heads=4, select_size=64, num_selected=16, num_init=1,
                             num_local=2)

    want = topk()
    for method in u.TOPK_METHODS:
        for rows, warps in LAUNCHES:
            def timed():
                return _time(topk), topk()

            try:
                ms, got = _with_flag(u, "TOPK_METHOD", method, lambda: _with_flag(  # noqa: B023
                    u, "TOPK_CONFIG", dict(rows=rows, num_warps=warps), timed))  # noqa: B023
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
            fwd, _ = _with_flag(u, "TOPK_METHOD", method, lambda: _with_flag(  # noqa: B023
                u, "TOPK_CONFIG", cfg, lambda: bench_nsa_prefill(T, hq, 4, 128)))  # noqa: B023
            print(f"prefill fwd hq={hq} {method} {cfg}: {fwd:.2f} ms", flush=True)


if __name__ == "__main__":
    main()

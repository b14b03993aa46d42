"""The importance kernel's unmasked chunks and lane-ordered map, and the top-k, timed side by side (H200).

    PYTHONPATH=. python3 scripts/probe_importance.py [launches | g4rounds]

At 64k (64/4 and 16/4 heads, random inputs): `block_importance` alone with
`IMPORTANCE_SPLIT_MASK` and `IMPORTANCE_LANE_MAP` each on and off (and a check that all four give
the same importances up to float32 rounding), `topk_blocks` alone for every method, then the NSA
forward with both importance flags on (the defaults) and off, each with the arg-max and the filter
top-k. Runs 18, 19 and 22: reports/kernels/probe_run18.log, probe_run19.log, probe_run22.log.
"""

import sys

import torch

from nsa_eval.bench.kernels import _inputs, _time, _with_flag, _with_flags, bench_nsa_prefill, nsa_prefill
from nsa_eval.kernels import importance, topk
from nsa_eval.kernels.compression import compressed_attention

T = 65536


def with_flags(split, lanes, fn):
    return _with_flags(importance, dict(IMPORTANCE_SPLIT_MASK=split, IMPORTANCE_LANE_MAP=lanes), fn)


def importance_fn(hq):
    """`block_importance` at T, hq/4 heads, d = 128, on random inputs and their compression lse, as a
    function of no arguments."""
    x = _inputs(1, T, hq, 4, 128, grad=False)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
    return lambda: importance.block_importance(x["q"], x["k_cmp"], lse, block_len=32, stride=16,
                                               select_size=64, scale=128 ** -0.5)


def probe(hq):
    importances = importance_fn(hq)
    with torch.no_grad():
        ns = T // 64
        own = (torch.arange(ns, device="cuda")[None, :] <= (torch.arange(T, device="cuda") // 64)[:, None])
        own = own.repeat_interleave(4, 0)
        want = with_flags(False, False, importances)[own]
        for split in (False, True):
            for lanes in (False, True):
                got = with_flags(split, lanes, importances)[own]
                err = ((got - want).abs() / want.abs().clamp_min(1e-6)).max().item()
                ms = with_flags(split, lanes, lambda: _time(importances))
                print(f"hq={hq} importance split_mask={split!s:5s} lane_map={lanes!s:5s}: {ms:.3f} ms, "
                      f"max rel diff {err:.1e}", flush=True)
        imp = importances()

        def run_topk():
            return topk.topk_blocks(imp, T=T, num_kv_heads=4, select_size=64, num_selected=16, num_init=1,
                                    num_local=2)

        want = run_topk()
        for method in topk.TOPK_METHODS:
            got = _with_flag(topk, "TOPK_METHOD", method, run_topk)
            ms = _with_flag(topk, "TOPK_METHOD", method, lambda: _time(run_topk))
            print(f"hq={hq} topk {method:8s}: {ms:.3f} ms, same={torch.equal(got, want)}", flush=True)
    torch.cuda.empty_cache()


LAUNCHES = ((128, 8, 3), (128, 8, 2), (128, 8, 4), (128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 4, 2),
            (64, 4, 4), (64, 8, 3), (128, 8, 3))  # (rows, warps, stages), the default first and last


def with_launch(launch, fn):
    rows, warps, stages = launch
    config = {**importance.IMPORTANCE_CONFIG, "reshape": dict(rows=rows, num_warps=warps, num_stages=stages)}
    return _with_flags(importance, dict(IMPORTANCE_CONFIG=config, RESHAPE_LAUNCH_BY_GROUP=None), fn)


def importance_launches():
    """{(rows, warps, stages): ms} of the importance kernel alone at 16/4 heads, printed as measured."""
    importances = importance_fn(16)
    with torch.no_grad():
        want = importances()
        own = want > 0
        timed = {}
        for launch in LAUNCHES:
            label = "hq=16 importance {} rows, {} warps, {} stages".format(*launch)
            try:
                got = with_launch(launch, importances)
                ms = with_launch(launch, lambda: _time(importances))
            except Exception as e:  # a launch that does not fit is a result too
                print(f"{label}: failed, {type(e).__name__}", flush=True)
                continue
            err = ((got[own] - want[own]).abs() / want[own]).max().item()
            timed[launch] = ms
            print(f"{label}: {ms:.3f} ms, max rel diff {err:.1e}", flush=True)
    return timed


def launches():
    """Run 103: the importance kernel's launch at G = 4 (16/4 heads; `importance_launch` caps its rows
    at 128 below G' = 16), alone and in the forward, around the default (128 rows, 8 warps, 3 stages)."""
    timed = importance_launches()
    torch.cuda.empty_cache()
    best = min(timed, key=timed.get)
    for label, launch in (("default", (128, 8, 3)), ("fastest", best)) * 2:
        fwd, _ = with_launch(launch, lambda: bench_nsa_prefill(T, 16, 4, 128))
        print(f"prefill fwd hq=16, importance {label} {launch}: {fwd:.2f} ms", flush=True)


def g4_rounds(rounds=5):
    """Run 108: run 103's fastest G = 4 launch (128 rows, 4 warps, 2 stages; the default since run
    108, `importance.RESHAPE_LAUNCH_BY_GROUP`) against the launch before it in the G = 4 forward,
    `rounds` rounds in alternation, each beside the G = 16 forward (which keeps its launch) for the
    per-head ratio of the issue's target (4 x G = 4's forward / G = 16's <= 2)."""
    inputs = {hq: _inputs(1, T, hq, 4, 128, grad=False) for hq in (64, 16)}

    def forward(hq):
        with torch.no_grad():
            return _time(lambda: nsa_prefill(**inputs[hq]))

    for r in range(rounds):
        g16 = forward(64)
        for label, launch in (("8 warps, 3 stages", (128, 8, 3)), ("4 warps, 2 stages", (128, 4, 2))):
            g4 = with_launch(launch, lambda: forward(16))
            print(f"round {r}: G=4 forward, importance {label}: {g4:.2f} ms; G=16 forward {g16:.2f} ms; "
                  f"per-head ratio {4 * g4 / g16:.3f}", flush=True)


def main():
    for hq in (64, 16):
        probe(hq)
    for hq in (64, 16):
        for split, lanes in ((True, True), (False, False)):
            for method in ("argmax", "filter"):
                fwd, _ = with_flags(split, lanes, lambda: _with_flag(  # noqa: B023
                    topk, "TOPK_METHOD", method, lambda: bench_nsa_prefill(T, hq, 4, 128)))  # noqa: B023
                print(f"prefill fwd hq={hq} split_mask={split} lane_map={lanes} top-k {method}: {fwd:.2f} ms",
                      flush=True)


if __name__ == "__main__":
    {"launches": launches, "g4rounds": g4_rounds}.get(" ".join(sys.argv[1:]), main)()

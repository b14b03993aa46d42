"""The backward's selected dk/dv kernel after run 83's Nsight Compute profile (ncu_run83.log), on the H200.

    PYTHONPATH=. python3 scripts/probe_order.py [launches] [T]   (default 65536; 64/4 heads, d = 128, bf16)

The selected op's and the whole NSA's forward+backward with each work item's positions loaded once
before the kernel's loop or at every step (`selection.SELECTED_DKV_PRELOAD`; run 85).
`launches` (run 86): the dk/dv kernel's stages, rows and warps with its positions preloaded.
Runs 84-85 also timed two work orders for L2 reuse (added in commit 2005e4d, removed in cf65d50):
the compression's dk/dv walking its query tiles downward, and the selected dk/dv's work list cut
into windows of positions (docs/kernel_runs.md).
Each line also gives the largest relative difference of dq, dk and dv from the first line of its
section (same inputs and output gradient): the orders add the same terms in another order.
"""

import sys

import torch
import triton

from nsa_eval.bench import _inputs, _with_flags, nsa_prefill
from nsa_eval.kernels import selection
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.importance import select_blocks
from nsa_eval.kernels.selection import selected_attention

D = 128


def grads_and_time(fn, leaves, do, knobs):
    """(gradients of fn's output against do, median ms of a forward+backward) under knobs:
    {selection: {name: value}}."""
    def run():
        for x in leaves:
            x.grad = None
        fn().backward(do)

    def measure():
        run()
        got = [x.grad.clone() for x in leaves]
        return got, triton.testing.do_bench(run, warmup=100, rep=1500, return_mode="median")

    return _with_flags(selection, knobs.get(selection, {}), measure)


def section(title, fn, leaves, variants):
    print(title, flush=True)
    do = torch.randn_like(fn())
    first = None
    for label, knobs in variants.items():
        try:
            got, ms = grads_and_time(fn, leaves, do, knobs)
        except Exception as e:  # a variant that fails is a result too
            print(f"  {label}: failed, {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        if first is None:
            first = got
        diff = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                   for a, b in zip(got, first, strict=True))
        print(f"  {label}: {ms:.2f} ms (gradients {diff:.1e} from the first)", flush=True)


def launches(T):
    """The selected op's forward+backward with the dk/dv kernel's launch around the defaults (its
    positions preloaded): pipeline stages, rows per MMA (and so positions per work item), warps."""
    x = _inputs(1, T, 64, 4, D, grad=True)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    sel_fn = lambda: selected_attention(x["q"], x["k"], x["v"], idx)  # noqa: E731
    title = f"T={T}, Triton {triton.__version__}, selected op, forward+backward, dk/dv launches:"
    section(title, sel_fn, [x["q"], x["k"], x["v"]], {
        "defaults": {},
        **{f"{n} stages": {selection: {"SELECTED_DKV_CONFIG": dict(num_stages=n)}} for n in (2, 4)},
        **{f"{rows} rows": {selection: {"SELECTED_DKV_ROWS": rows}} for rows in (32, 128)},
        "128 rows, 2 stages": {selection: {"SELECTED_DKV_ROWS": 128,
                                           "SELECTED_DKV_CONFIG": dict(num_stages=2)}},
        "4 warps": {selection: {"SELECTED_DKV_CONFIG": dict(num_stages=3, num_warps=4)}},
        "defaults (again)": {},
    })


def main(T):
    x = _inputs(1, T, 64, 4, D, grad=True)
    print(f"T={T}, 64/4 heads, d={D}, bf16, Triton {triton.__version__}", flush=True)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    sel_fn = lambda: selected_attention(x["q"], x["k"], x["v"], idx)  # noqa: E731
    per_step, preloaded = ({selection: {"SELECTED_DKV_PRELOAD": pre}} for pre in (False, True))
    section("selected op, forward+backward:", sel_fn, [x["q"], x["k"], x["v"]], {
        "positions loaded per step (before)": per_step, "positions preloaded": preloaded})
    nsa_fn = lambda: nsa_prefill(**x)  # noqa: E731
    leaves = [t for t in x.values() if t.requires_grad]
    section("NSA, forward+backward:", nsa_fn, leaves, {
        "positions loaded per step (before)": per_step, "positions preloaded": preloaded,
        "positions loaded per step (again)": per_step, "positions preloaded (again)": preloaded})


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = launches if args and args[0] == "launches" else main
    args = args[1:] if mode is launches else args
    mode(int(args[0]) if args else 65536)

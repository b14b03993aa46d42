"""The backward's selected dk/dv kernel after run 83's Nsight Compute profile (ncu_run83.log), on the H200.

    PYTHONPATH=. python3 scripts/probe_order.py [launches | dkv | dkv192 | nsa192] [T]
    (default 65536; 64/4 heads, d = 128, bf16)

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

from nsa_eval.bench.kernels import _inputs, _with_flags, nsa_prefill
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
    """The selected op's forward+backward with the dk/dv kernel's launch around the defaults before run
    103 (its positions preloaded): pipeline stages, rows per MMA (and so positions per work item),
    warps (runs 86 and 90)."""
    x = _inputs(1, T, 64, 4, D, grad=True)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    sel_fn = lambda: selected_attention(x["q"], x["k"], x["v"], idx)  # noqa: E731
    title = f"T={T}, Triton {triton.__version__}, selected op, forward+backward, dk/dv launches:"

    def knobs(**flags):  # around the launch before run 103 (SELECTED_DKV_WIDE off)
        return {selection: {"SELECTED_DKV_WIDE": None, **flags}}

    section(title, sel_fn, [x["q"], x["k"], x["v"]], {
        "64 rows, 3 stages": knobs(),
        **{f"{n} stages": knobs(SELECTED_DKV_CONFIG=dict(num_stages=n)) for n in (2, 4)},
        **{f"{rows} rows": knobs(SELECTED_DKV_ROWS=rows) for rows in (32, 128)},
        "128 rows, 2 stages": knobs(SELECTED_DKV_ROWS=128, SELECTED_DKV_CONFIG=dict(num_stages=2)),
        "4 warps": knobs(SELECTED_DKV_CONFIG=dict(num_stages=3, num_warps=4)),
        "64 rows, 3 stages (again)": knobs(),
    })


def dkv_tiles(T):
    """Run 103: the dk/dv kernel at 8 warps over 64 rows computes its score and dp products twice
    (Triton gives a dot whose result feeds another dot warpsPerCTA = [8, 1], 128 rows of warps for a
    64-row tile, so both warpgroups hold the same rows). 128 rows fill both, with the head dim in two
    column halves (`split_dk`) at 2 stages: `selection.SELECTED_DKV_WIDE`, the default since run 103,
    against the launch before it and its parts. Run 103 also timed the scores as k q^T (removed after
    it lost: 45.30-45.85 ms at 64 rows, 57.47 at 128) and 128 rows with the split at 3 and 4 stages,
    which need 264,192 and 330,752 bytes of shared memory. The selected op and the NSA,
    forward+backward, G = 16 and G = 4."""
    def wide(**launch):
        return {selection: {"SELECTED_DKV_WIDE": {(D, D): launch} if launch else None}}

    variants = {
        "defaults (128 rows, split, 2 stages)": {},
        "64 rows, 3 stages (before run 103)": wide(),
        "64 rows, split, 3 stages": wide(rows=64, split_dk=True, num_stages=3),
        "128 rows, 2 stages": wide(rows=128, split_dk=False, num_stages=2),
        "defaults (again)": {},
    }
    best = {k: variants[k] for k in ("defaults (128 rows, split, 2 stages)",
                                     "64 rows, 3 stages (before run 103)")}
    _dkv_sections(T, 64, variants, {**best, **{f"{k} (again)": v for k, v in best.items()}})
    torch.cuda.empty_cache()
    _dkv_sections(T, 16, best, best)


def dkv_paper_dims(T):
    """Run 105: the paper's q/k dim of 192 (two column tiles already, 128 + 64) with v dims of 128,
    where `selected_dkv_launch` kept 64 rows at 3 stages, over which 8 warps compute the scores and
    dp twice as at 128 (run 103): the selected op's forward+backward at 128 rows, 2 stages (which
    need 271,360 bytes of shared memory) and 1 (the default since run 105)."""
    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True)

    tc = (T - 32) // 16 + 1
    q, k, v, k_cmp, v_cmp = rnd(1, T, 64, 192), rnd(1, T, 4, 192), rnd(1, T, 4, 128), rnd(1, tc, 4, 192), \
        rnd(1, tc, 4, 128)
    with torch.no_grad():
        _, lse = compressed_attention(q, k_cmp, v_cmp)
        idx = select_blocks(q, k_cmp, lse=lse)
    sel_fn = lambda: selected_attention(q, k, v, idx)  # noqa: E731

    def paper(launch):  # SELECTED_DKV_WIDE with 192 / 128's launch replaced (None: left out)
        table = {dims: cfg for dims, cfg in (selection.SELECTED_DKV_WIDE or {}).items() if dims != (192, 128)}
        return {selection: {"SELECTED_DKV_WIDE": table | ({(192, 128): launch} if launch else {})}}

    before = paper(None)
    section(f"T={T}, 64/4 heads, Dk=192, Dv=128, Triton {triton.__version__}, selected op, forward+backward:",
            sel_fn, [q, k, v], {"defaults (128 rows, 1 stage)": {},
                                "64 rows, 3 stages (before run 105)": before,
                                "128 rows, 2 stages": paper(dict(rows=128, num_stages=2)),
                                "defaults (again)": {}, "64 rows, 3 stages (again)": before})


def nsa_paper_dims(T):
    """Run 108: the whole NSA's forward+backward at the paper's dims (q/k 192, v 128, 64/4 heads) with
    run 105's dk/dv launch for them (the default) and the one before it, in alternation."""
    x = _inputs(1, T, 64, 4, 192, grad=True)
    for name in ("v", "v_cmp"):
        x[name] = x[name][..., :128].detach().contiguous().requires_grad_()
    table = {dims: cfg for dims, cfg in selection.SELECTED_DKV_WIDE.items() if dims != (192, 128)}
    before = {selection: {"SELECTED_DKV_WIDE": table}}
    section(f"T={T}, 64/4 heads, Dk=192, Dv=128, Triton {triton.__version__}, NSA, forward+backward:",
            lambda: nsa_prefill(**x), [t for t in x.values() if t.requires_grad],
            {"defaults (128 rows, 1 stage)": {}, "64 rows, 3 stages (before run 105)": before,
             "defaults (again)": {}, "64 rows, 3 stages (again)": before})


def _dkv_sections(T, hq, op_variants, nsa_variants):
    x = _inputs(1, T, hq, 4, D, grad=True)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    sel_fn = lambda: selected_attention(x["q"], x["k"], x["v"], idx)  # noqa: E731
    section(f"T={T}, {hq}/4 heads, Triton {triton.__version__}, selected op, forward+backward:", sel_fn,
            [x["q"], x["k"], x["v"]], op_variants)
    nsa_fn = lambda: nsa_prefill(**x)  # noqa: E731
    section(f"T={T}, {hq}/4 heads, NSA, forward+backward:", nsa_fn,
            [t for t in x.values() if t.requires_grad], nsa_variants)


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
    modes = {"launches": launches, "dkv": dkv_tiles, "dkv192": dkv_paper_dims, "nsa192": nsa_paper_dims}
    mode = modes.get(args[0] if args else "", main)
    args = args[1:] if mode is not main else args
    mode(int(args[0]) if args else 65536)

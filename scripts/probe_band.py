"""The banded kernels' launch order and dk/dv launches, timed side by side at 64k (H200).

    PYTHONPATH=. python3 scripts/probe_band.py

Forward+backward of the compression and window branches (64/4 heads, random inputs) with the
default configuration, with the tiles launched in index order (`BAND_LONGEST_FIRST = False`) and
with other dk/dv launches, masked or split (`BAND_SPLIT_MASK`); then the whole NSA with each launch
order. Run 21: reports/kernels/band_run21.log.

    PYTHONPATH=. python3 scripts/probe_band.py triton38

Run 91, for the Triton the project pins (3.8; every default below was chosen under the H200 image's
3.6, and run 88's benchmark timed the window's backward split at 12.96 ms against 13.40 masked, where
3.6 had it at 17.8 against 14.4-15.0): the window's forward+backward with its dq and dk/dv each masked
or split, the compression's dq and dk/dv launches (and its dq through TMA), the compression forward's
launch at 8k and 64k, each in alternation with the default; then the whole NSA with the window's
backward masked and split, twice each.

    PYTHONPATH=. python3 scripts/probe_band.py nsa38

Run 93 (Triton 3.8): the whole NSA's 64k forward+backward, medians of at least 5 calls since run 92,
three rounds of the defaults, the window's backward masked and the compression's dq through TMA.

    PYTHONPATH=. python3 scripts/probe_band.py dqsum

Run 94 (Triton 3.8): the NSA's 64k forward+backward (64/4 and 16/4 heads) with each way of summing
the branches' dq (`prefill.DQ_SUM`), in alternation, and the peak memory of one step with each.

    PYTHONPATH=. python3 scripts/probe_band.py gatesum

Run 96 (Triton 3.8): the NSA's forward (64k at 64/4 and 16/4 heads, 8k at 64/4) and 64k
forward+backward with the gated sum in the selected forward's epilogue (`prefill.GATE_IN_SELECTED`)
and as a pass of its own, in alternation, three rounds.

    PYTHONPATH=. python3 scripts/probe_band.py order

Run 98 (Triton 3.8): runs 92, 95 and 97 timed the 64k forward 0.6-0.8 ms faster with every banded
kernel in index order (`BAND_LONGEST_FIRST = False`) and the forward+backward 1.9-4.1 ms slower. The
NSA's forward (64k at 64/4 and 16/4 heads, 8k at 64/4) with each branch's forward in either order,
three rounds in alternation, then the 64k forward+backward with the forwards in index order and the
backward longest first, against the default.

    PYTHONPATH=. python3 scripts/probe_band.py widekeys

Run 104 (Triton 3.8): the dk/dv kernels over 128-key tiles at 8 warps (`probe_wide_keys`); they
lost in both branches and in the NSA (112.21 / 111.44 ms against 107.34 / 108.19).
"""

import sys

import torch

from nsa_eval.bench.kernels import _fwd_bwd, _inputs, _time, _with_flag, _with_flags, bench_nsa_prefill, nsa_prefill
from nsa_eval.kernels import band
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.window import sliding_window_attention

T = 65536
DKV = [(64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2)]  # (BM, BN, warps, stages) besides the default


def with_band(fn, *, configs=None, split=None, tma=None):
    """fn() with BAND_CONFIGS[branch][part] = cfg for each (branch, part, cfg) in configs, and the
    branches' BAND_SPLIT_MASK / BAND_TMA parts replaced by split / tma ({branch: parts})."""
    table = {b: dict(parts) for b, parts in band.BAND_CONFIGS.items()}
    for branch, part, (bm, bn, warps, stages) in configs or ():
        table[branch][part] = dict(BM=bm, BN=bn, num_warps=warps, num_stages=stages)
    flags = {"BAND_CONFIGS": table, "BAND_SPLIT_MASK": {**band.BAND_SPLIT_MASK, **(split or {})},
             "BAND_TMA": {**band.BAND_TMA, **(tma or {})}}
    return _with_flags(band, flags, fn)


def with_dkv(branch, cfg, split, fn):
    """fn() with the branch's dk/dv launch cfg (None: the default) and its dk/dv masked or split."""
    parts = set(band.BAND_SPLIT_MASK[branch]) - {"dkv"}
    return with_band(fn, configs=[(branch, "dkv", cfg)] if cfg is not None else None,
                     split={branch: tuple(sorted(parts | ({"dkv"} if split else set())))})


def probe_branches():
    x = _inputs(1, T, 64, 4, 128, grad=True)
    branches = {"cmp": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
                "swa": lambda: sliding_window_attention(x["q"], x["k"], x["v"])}
    for branch, fn in branches.items():
        step = _fwd_bwd(fn, x)
        default_split = "dkv" in band.BAND_SPLIT_MASK[branch]
        for longest in (True, False, True):
            ms = _with_flag(band, "BAND_LONGEST_FIRST", longest, lambda: _time(step))  # noqa: B023
            print(f"{branch} fwd+bwd default, longest_first={longest}: {ms:.2f} ms", flush=True)
        with torch.no_grad():
            for longest in (True, False):
                ms = _with_flag(band, "BAND_LONGEST_FIRST", longest, lambda: _time(fn))  # noqa: B023
                print(f"{branch} fwd default, longest_first={longest}: {ms:.2f} ms", flush=True)
        for cfg in [None, *DKV]:
            for split in (False, True):
                if cfg is None and split == default_split:
                    continue
                try:
                    ms = with_dkv(branch, cfg, split, lambda: _time(step))  # noqa: B023
                    print(f"{branch} fwd+bwd dkv={cfg or 'default'} split={split}: {ms:.2f} ms", flush=True)
                except Exception as err:  # a launch may not compile or fit
                    print(f"{branch} dkv={cfg} split={split} failed: {str(err).splitlines()[0][:120]}")


def timed(label, fn, **changes):
    try:
        print(f"{label}: {with_band(fn, **changes):.2f} ms", flush=True)
    except Exception as err:  # a launch may not compile or fit
        print(f"{label} failed: {str(err).splitlines()[0][:120]}", flush=True)


def probe_ops_triton38():
    x = _inputs(1, T, 64, 4, 128, grad=True)
    swa = _fwd_bwd(lambda: sliding_window_attention(x["q"], x["k"], x["v"]), x)
    for rep in range(2):
        for parts in (("fwd",), ("fwd", "dq"), ("fwd", "dkv"), ("fwd", "dq", "dkv")):
            timed(f"[{rep}] swa fwd+bwd split {'+'.join(parts)}", lambda: _time(swa), split={"swa": parts})
    cmp_fn = lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0]  # noqa: E731
    cmp = _fwd_bwd(cmp_fn, x)
    timed("cmp fwd+bwd default", lambda: _time(cmp))
    for part, cfgs in (("dq", [(128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)]),
                       ("dkv", [(64, 64, 4, 3), (128, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2)])):
        for cfg in cfgs:
            timed(f"cmp fwd+bwd {part}={cfg}", lambda: _time(cmp), configs=[("cmp", part, cfg)])
    timed("cmp fwd+bwd dq through TMA", lambda: _time(cmp), tma={"cmp": ("fwd", "dq", "dkv")})
    timed("cmp fwd+bwd default", lambda: _time(cmp))
    for t in (8192, T):
        y = _inputs(1, t, 64, 4, 128, grad=False)
        with torch.no_grad():
            fwd = lambda y=y: compressed_attention(y["q"], y["k_cmp"], y["v_cmp"])[0]  # noqa: E731
            for cfg in (None, (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)):
                timed(f"T={t} cmp fwd fwd_tma={cfg or 'default'}", lambda: _time(fwd),  # noqa: B023
                      configs=[("cmp", "fwd_tma", cfg)] if cfg else None)


def probe_triton38():
    probe_ops_triton38()
    torch.cuda.empty_cache()
    for rep in range(2):
        for parts in (("fwd",), ("fwd", "dq", "dkv")):
            fwd, fb = with_band(lambda: bench_nsa_prefill(T, 64, 4, 128), split={"swa": parts})
            print(f"[{rep}] nsa 64/4 window split {'+'.join(parts)}: fwd {fwd:.2f} ms, fwd+bwd {fb:.2f} ms",
                  flush=True)


def probe_nsa38():
    x = _inputs(1, T, 64, 4, 128, grad=True)
    step = _fwd_bwd(lambda: nsa_prefill(**x), x)
    variants = {"defaults": {}, "window backward masked": dict(split={"swa": ("fwd",)}),
                "compression dq through TMA": dict(tma={"cmp": ("fwd", "dq", "dkv")})}
    for rep in range(3):
        for name, changes in variants.items():
            timed(f"[{rep}] nsa 64/4 fwd+bwd {name}", lambda: _time(step), **changes)  # noqa: B023


def probe_dq_sum():
    for hq, rounds in ((64, 4), (16, 2)):
        dq_sums(hq, rounds)
        torch.cuda.empty_cache()


def dq_sums(hq, rounds):
    from nsa_eval.kernels import prefill

    x = _inputs(1, T, hq, 4, 128, grad=True)
    step = _fwd_bwd(lambda: nsa_prefill(**x), x)
    for mode in prefill.DQ_SUMS:  # peak memory of one step above the inputs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _with_flag(prefill, "DQ_SUM", mode, step)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"nsa {hq}/4 fwd+bwd dq sum {mode}: peak {peak:.2f} GiB above the inputs", flush=True)
    for rep in range(rounds):
        for mode in prefill.DQ_SUMS:
            ms = _with_flag(prefill, "DQ_SUM", mode, lambda: _time(step))
            print(f"[{rep}] nsa {hq}/4 fwd+bwd dq sum {mode}: {ms:.2f} ms", flush=True)


def probe_gate_sum():
    for t, hq, grad in ((T, 64, False), (T, 16, False), (8192, 64, False), (T, 64, True)):
        gate_sums(t, hq, grad)
        torch.cuda.empty_cache()


def gate_sums(t, hq, grad):
    from nsa_eval.kernels import prefill

    x = _inputs(1, t, hq, 4, 128, grad=grad)
    fn = _fwd_bwd(lambda: nsa_prefill(**x), x) if grad else lambda: nsa_prefill(**x)
    label = f"T={t} nsa {hq}/4 {'fwd+bwd' if grad else 'fwd'}"
    for rep in range(3):
        for fused in (True, False):
            with torch.set_grad_enabled(grad):
                ms = _with_flag(prefill, "GATE_IN_SELECTED", fused, lambda: _time(fn))
            where = "in selected" if fused else "apart"
            print(f"[{rep}] {label} gated sum {where}: {ms:.3f} ms", flush=True)


ORDERS = {  # BAND_LONGEST_FIRST: the kernels launched longest first, per branch
    "longest first": True,
    "index order": False,
    "cmp fwd in index order": {"cmp": ("dq", "dkv"), "swa": ("fwd", "dq", "dkv")},
    "swa fwd in index order": {"cmp": ("fwd", "dq", "dkv"), "swa": ("dq", "dkv")},
    "forwards in index order": {"cmp": ("dq", "dkv"), "swa": ("dq", "dkv")},
}


def probe_order():
    for t, hq in ((T, 64), (T, 16), (8192, 64)):
        x = _inputs(1, t, hq, 4, 128, grad=False)
        forward = lambda: _time(lambda: nsa_prefill(**x))  # noqa: B023, E731
        for rep in range(3):
            for name, order in ORDERS.items():
                with torch.no_grad():
                    ms = _with_flag(band, "BAND_LONGEST_FIRST", order, forward)
                print(f"[{rep}] T={t} nsa {hq}/4 fwd, {name}: {ms:.3f} ms", flush=True)
        del x, forward
        torch.cuda.empty_cache()
    x = _inputs(1, T, 64, 4, 128, grad=True)
    step = _fwd_bwd(lambda: nsa_prefill(**x), x)
    for rep in range(3):
        for name in ("longest first", "forwards in index order"):
            ms = _with_flag(band, "BAND_LONGEST_FIRST", ORDERS[name], lambda: _time(step))
            print(f"[{rep}] T={T} nsa 64/4 fwd+bwd, {name}: {ms:.2f} ms", flush=True)


WIDE_KEYS = [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2)]  # (BM, BN, warps, stages), 128 keys


def probe_wide_keys():
    """Run 104: the banded dk/dv over 128-key tiles at 8 warps. Every 8-warp dk/dv launch timed before
    (runs 5-91) had 64-key tiles, over which Triton's [8, 1] warps for a chained dot compute the scores
    and dp twice (run 103, `selection.SELECTED_DKV_WIDE`); 128 keys give each warpgroup its own 64, and
    halve the reads of the query and do tiles. Each branch's forward+backward, then the NSA's."""
    x = _inputs(1, T, 64, 4, 128, grad=True)
    branches = {"cmp": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
                "swa": lambda: sliding_window_attention(x["q"], x["k"], x["v"])}
    fastest = {}
    for branch, fn in branches.items():
        step = _fwd_bwd(fn, x)
        timed(f"{branch} fwd+bwd default", lambda: _time(step))  # noqa: B023
        best = None  # (ms, cfg)
        for cfg in WIDE_KEYS:
            try:
                ms = with_band(lambda: _time(step), configs=[(branch, "dkv", cfg)])  # noqa: B023
            except Exception as err:  # a launch may not compile or fit
                print(f"{branch} fwd+bwd dkv={cfg} failed: {str(err).splitlines()[0][:120]}", flush=True)
                continue
            print(f"{branch} fwd+bwd dkv={cfg}: {ms:.2f} ms", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        timed(f"{branch} fwd+bwd default (again)", lambda: _time(step))  # noqa: B023
        if best is not None:
            fastest[branch] = best[1]
    step = _fwd_bwd(lambda: nsa_prefill(**x), x)
    configs = [(branch, "dkv", cfg) for branch, cfg in fastest.items()]
    for rep in range(2):
        timed(f"[{rep}] nsa 64/4 fwd+bwd default", lambda: _time(step))
        timed(f"[{rep}] nsa 64/4 fwd+bwd dkv {fastest}", lambda: _time(step), configs=configs)


def main():
    probes = {"triton38": probe_triton38, "nsa38": probe_nsa38, "dqsum": probe_dq_sum,
              "gatesum": probe_gate_sum, "order": probe_order, "widekeys": probe_wide_keys}
    if sys.argv[1:2] and sys.argv[1] in probes:
        import triton

        print(f"Triton {triton.__version__}, torch {torch.__version__}", flush=True)
        probes[sys.argv[1]]()
        return
    probe_branches()
    torch.cuda.empty_cache()
    for longest in (True, False, True, False):
        fwd, fb = _with_flag(band, "BAND_LONGEST_FIRST", longest,
                             lambda: bench_nsa_prefill(T, 64, 4, 128))
        print(f"nsa 64/4 longest_first={longest}: fwd {fwd:.2f} ms, fwd+bwd {fb:.2f} ms", flush=True)


if __name__ == "__main__":
    main()

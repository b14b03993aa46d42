"""Key and value tiles through Hopper's tensor memory accelerator (run 66 on the H200): the selected
forward (`selection.SELECTED_TMA`) and the banded forward (`band.BAND_TMA`) with their K/V read by
TMA bulk copies from tensor descriptors, against per-thread loads, side by side on one GPU.

    PYTHONPATH=. python3 scripts/probe_tma.py [forward] [backward]   (default: both)
    PYTHONPATH=. python3 scripts/probe_tma.py sweep | positions | tiles

forward (run 66), per shape (64k and 8k at 64/4 heads, 64k at 16/4): each op's forward with TMA off
and on (and a few launches with it on), the max |diff| of TMA against the loads, and the whole NSA
forward both ways. backward (runs 67-68): each op's forward+backward and the whole NSA's with TMA off
and on (`band.BAND_TMA` for the banded dq and dk/dv too), and the banded kernels' TMA by part. Those
runs also timed the fused decode with TMA copies (`decode.DECODE_TMA`, at commit a42f3e0): slower,
removed. sweep (run 71): launch configurations on the TMA defaults. positions (run 73): G = 16's
selected forward at 2 and 4 positions a program. tiles (run 82): the banded forwards' tiles again
after the scale fold of run 78.
"""

import sys

import torch

from nsa_eval.bench.kernels import _fwd_bwd, _inputs, _time, _with_flags, nsa_prefill
from nsa_eval.kernels import band, selection
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.importance import select_blocks
from nsa_eval.kernels.selection import selected_attention
from nsa_eval.kernels.window import sliding_window_attention

D = 128


def with_tma(on: bool, fn, sel_knobs=None, band_configs=None):
    def inner():
        knobs = {"SELECTED_TMA": on, **(sel_knobs or {})}
        return _with_flags(selection, knobs, fn)

    flags = {"BAND_TMA": on, **({"BAND_CONFIGS": band_configs} if band_configs else {})}
    return _with_flags(band, flags, inner)


def band_variant(branch, **changes):
    configs = {b: {p: dict(c) for p, c in parts.items()} for b, parts in band.BAND_CONFIGS.items()}
    configs[branch]["fwd"].update(changes)
    return configs


def timed(label, fn, want=None, tma=True, **knobs):
    """Print fn's time with TMA on or off (and the selected / banded knobs), and with `want` (fn's
    output with TMA off) its max |diff|."""
    try:
        got = with_tma(True, fn, **knobs) if want is not None else None
        err = "" if got is None else f", max |diff| {(got.float() - want.float()).abs().max().item():.1e}"
        ms = with_tma(tma, lambda: _time(fn), **knobs)
        print(f"  {label}: {ms:.3f} ms{err}", flush=True)
    except Exception as e:  # a launch that does not compile is a result too
        print(f"  {label}: failed, {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def problem(T, hq, hkv, grad):
    """The benchmark's inputs at T (bf16, d = 128), the block lists `select_blocks` makes of them, and
    each op on them: {"selected", "compression", "window", "nsa"} -> fn() giving its output."""
    x = _inputs(1, T, hq, hkv, D, grad=grad)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    ops = {
        "selected": lambda: selected_attention(x["q"], x["k"], x["v"], idx),
        "compression": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
        "window": lambda: sliding_window_attention(x["q"], x["k"], x["v"]),
        "nsa": lambda: nsa_prefill(**x),
    }
    return x, idx, ops


def probe(T, hq, hkv):
    print(f"T={T}, {hq}/{hkv} heads, d={D}, bf16:", flush=True)
    _, _, ops = problem(T, hq, hkv, grad=False)
    with torch.no_grad():
        for name, fn in ops.items():
            want = with_tma(False, fn)
            timed(f"{name} loads", fn, tma=False)
            timed(f"{name} TMA", fn, want)
            timed(f"{name} loads again", fn, tma=False)
        multi = hq // hkv < 16
        key = "SELECTED_FWD_CONFIG_MULTI" if multi else "SELECTED_FWD_CONFIG"
        for config in (dict(num_warps=1, num_stages=3), dict(num_warps=2, num_stages=2),
                       dict(num_warps=2, num_stages=3), dict(num_warps=4, num_stages=3),
                       dict(num_warps=1, num_stages=4)):
            timed(f"selected TMA {config}", ops["selected"], sel_knobs={key: config})
        for changes in (dict(num_stages=2), dict(num_stages=4), dict(BN=128, num_stages=2),
                        dict(BM=64, num_warps=4)):
            timed(f"compression TMA {changes}", ops["compression"],
                  band_configs=band_variant("cmp", **changes))


def probe_backward(T, hq, hkv):
    """Forward+backward of each op and of the whole NSA with TMA off and on; the banded kernels' TMA
    by part (forward, dq, dk/dv)."""
    print(f"T={T}, {hq}/{hkv} heads, d={D}, bf16, forward+backward:", flush=True)
    x, _, ops = problem(T, hq, hkv, grad=True)
    for name, fn in ops.items():
        step = _fwd_bwd(fn, x)
        want = grads(step, x, False)
        got = grads(step, x, True)
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got, strict=True))
        for tma in (False, True, False):
            ms = with_tma(tma, lambda step=step: _time(step))
            print(f"  {name} fwd+bwd {'TMA' if tma else 'loads'}: {ms:.2f} ms"
                  + (f", max |grad diff| {err:.1e}" if tma else ""), flush=True)
    every = ("fwd", "dq", "dkv")
    for band_tma in ({"cmp": ("fwd", "dq"), "swa": ("fwd", "dq")},
                     {"cmp": ("fwd", "dkv"), "swa": ("fwd", "dkv")},
                     {"cmp": ("fwd",), "swa": ("fwd",)}, {"cmp": ("fwd",), "swa": every},
                     {"cmp": ("fwd", "dq"), "swa": every}, {"cmp": ("fwd", "dkv"), "swa": every},
                     {"cmp": every, "swa": every}):
        for name in ("compression", "nsa"):
            step = _fwd_bwd(ops[name], x)
            ms = _with_flags(band, {"BAND_TMA": band_tma}, lambda step=step: _with_flags(
                selection, {"SELECTED_TMA": True}, lambda: _time(step)))
            print(f"  {name} fwd+bwd, banded TMA {band_tma}: {ms:.2f} ms", flush=True)


def grads(step, x, tma):
    with_tma(tma, step)
    return [t.grad.clone() for t in x.values() if t.grad is not None]


def band_part(branch, part, **changes):
    configs = {b: {p: dict(c) for p, c in parts.items()} for b, parts in band.BAND_CONFIGS.items()}
    configs[branch][part].update(changes)
    return {"BAND_CONFIGS": configs}


def probe_sweep(T, hq, hkv):
    """Launch configurations on the TMA defaults (run 71): the banded forwards, dq and dk/dv by op,
    G = 4's selected forward at 32 rows, and the selected forward's reads-alone floor both ways."""
    from nsa_eval.kernels.floors import gather_blocks_sum

    print(f"T={T}, {hq}/{hkv} heads, d={D}, bf16, on the defaults:", flush=True)
    x, idx, ops = problem(T, hq, hkv, grad=True)
    ops.update(cmp=ops["compression"], swa=ops["window"])  # by BAND_CONFIGS' branch names
    cases = [("cmp", "fwd_tma", c) for c in (dict(), dict(BM=128, num_warps=8), dict(BN=128, num_stages=2),
                                               dict(num_stages=4), dict(num_stages=2))]
    cases += [("swa", "fwd", c) for c in (dict(), dict(BM=128, num_warps=8), dict(num_stages=4),
                                          dict(num_stages=2), dict(BN=128, num_stages=2))]
    time_forwards(ops, cases)
    cases = [("cmp", "dkv", c) for c in (dict(), dict(num_stages=3), dict(num_warps=8), dict(BM=32))]
    cases += [("cmp", "dq", c) for c in (dict(num_stages=3),)]
    cases += [("swa", "dq", c) for c in (dict(num_stages=3), dict(BN=32))]
    cases += [("swa", "dkv", c) for c in (dict(num_stages=3), dict(BM=32))]
    for branch, part, changes in cases:
        step = _fwd_bwd(ops[branch], x)
        ms = _with_flags(band, band_part(branch, part, **changes), lambda step=step: _time(step))
        print(f"  {branch} fwd+bwd, {part} {changes or 'defaults'}: {ms:.2f} ms", flush=True)
    with torch.no_grad():
        for tma in (False, True):
            ms = _time(lambda tma=tma: gather_blocks_sum(x["k"], x["v"], idx, tma=tma))
            print(f"  selected reads alone, {'TMA' if tma else 'loads'}: {ms:.2f} ms", flush=True)
        print(f"  selected fwd: {_time(ops['selected']):.2f} ms, nsa fwd {_time(ops['nsa']):.2f} ms",
              flush=True)
        if hq // hkv < 16:
            for rows, config in ((32, dict(num_warps=2, num_stages=3)),
                                 (32, dict(num_warps=4, num_stages=3)),
                                 (32, dict(num_warps=4, num_stages=2)),
                                 (16, dict(num_warps=2, num_stages=4))):
                knobs = {"SELECTED_ROWS": rows, "SELECTED_FWD_CONFIG_MULTI_TMA": config}
                sel = _with_flags(selection, knobs, lambda: _time(ops["selected"]))
                whole = _with_flags(selection, knobs, lambda: _time(ops["nsa"]))
                print(f"  G=4 {knobs}: selected {sel:.2f} ms, nsa fwd {whole:.2f} ms", flush=True)


def probe_tiles(T, hq, hkv):
    """The banded forwards' tiles after the scale fold (run 82): wider key tiles halve acc's rescale
    per key; 8 warps share the larger tiles."""
    print(f"T={T}, {hq}/{hkv} heads, d={D}, bf16, on the defaults:", flush=True)
    _, _, ops = problem(T, hq, hkv, grad=False)
    ops.update(cmp=ops["compression"], swa=ops["window"])
    wide = (dict(), dict(BM=128, num_warps=8), dict(BM=128, BN=128, num_warps=8, num_stages=2),
            dict(BN=128, num_warps=8, num_stages=2), dict(BN=128, num_stages=2))
    parts = (("cmp", "fwd_tma"), ("swa", "fwd"))
    time_forwards(ops, [(branch, part, c) for branch, part in parts for c in wide])


def time_forwards(ops, cases):
    """Print each banded forward's time (ops by branch name) with its `BAND_CONFIGS[branch][part]`
    changed as in cases [(branch, part, changes)]."""
    for branch, part, changes in cases:
        try:
            flags = band_part(branch, part, **changes)
            with torch.no_grad():
                ms = _with_flags(band, flags, lambda fn=ops[branch]: _time(fn))
            print(f"  {branch} fwd, {part} {changes or 'defaults'}: {ms:.3f} ms", flush=True)
        except Exception as e:  # a launch that does not fit is a result too
            print(f"  {branch} fwd, {part} {changes}: failed, {str(e).splitlines()[0][:160]}", flush=True)


def probe_positions(T, hq=64, hkv=4):
    """G = 16's selected forward with TMA at 2 and 4 positions a program (`SELECTED_ROWS` 32 and 64:
    the union walk reads a block that several of its positions chose once), against one (run 73)."""
    print(f"T={T}, {hq}/{hkv} heads, selected forward with TMA by positions per program:", flush=True)
    _, _, ops = problem(T, hq, hkv, grad=False)
    fn, nsa = ops["selected"], ops["nsa"]
    with torch.no_grad():
        want = fn()
        whole = _time(nsa)
        print(f"  1 position (defaults): {_time(fn):.2f} ms, nsa fwd {whole:.2f} ms", flush=True)
        for rows in (32, 64):
            for warps, stages in ((1, 2), (2, 2), (2, 3), (4, 2), (4, 3)):
                knobs = {"SELECTED_ROWS": rows,
                         "SELECTED_FWD_CONFIG_MULTI_TMA": dict(num_warps=warps, num_stages=stages)}
                try:
                    err = (_with_flags(selection, knobs, fn).float() - want.float()).abs().max().item()
                    ms = _with_flags(selection, knobs, lambda: _time(fn))
                    whole = _with_flags(selection, knobs, lambda: _time(nsa))
                    print(f"  {rows // 16} positions, {warps} warps, {stages} stages: {ms:.2f} ms, nsa fwd "
                          f"{whole:.2f} ms, max |diff| {err:.1e}", flush=True)
                except Exception as e:
                    print(f"  {rows // 16} positions, {warps} warps, {stages} stages: failed, "
                          f"{str(e).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    modes = sys.argv[1:] or ["forward", "backward"]
    if "forward" in modes:  # run 66
        for T, hq, hkv in ((65536, 64, 4), (65536, 16, 4), (8192, 64, 4)):
            probe(T, hq, hkv)
            torch.cuda.empty_cache()
    if "backward" in modes:
        for T, hq, hkv in ((65536, 64, 4), (8192, 64, 4)):
            probe_backward(T, hq, hkv)
            torch.cuda.empty_cache()
    if "positions" in modes:  # run 73
        for T in (65536, 8192):
            probe_positions(T)
            torch.cuda.empty_cache()
    if "tiles" in modes:  # run 82
        for T, hq, hkv in ((65536, 64, 4), (8192, 64, 4)):
            probe_tiles(T, hq, hkv)
            torch.cuda.empty_cache()
    if "sweep" in modes:  # run 71
        for T, hq, hkv in ((65536, 64, 4), (65536, 16, 4), (8192, 64, 4)):
            probe_sweep(T, hq, hkv)
            torch.cuda.empty_cache()

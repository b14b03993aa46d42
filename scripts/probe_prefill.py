"""Questions about the prefill forward, timed side by side on one GPU (runs 37-50 on the H200).

    PYTHONPATH=. python3 scripts/probe_prefill.py [overlap] [g4]   (default: both)
    PYTHONPATH=. python3 scripts/probe_prefill.py dims | dims192 | dims192b | dims192c | gates | g4steps
    PYTHONPATH=. python3 scripts/probe_prefill.py g4launch | g4window

1. Overlap of the branches across KV heads. The compression forward and the importances are
   compute-bound, the selected walk waits on L2 reads. The benchmark's heads split into P
   independent parts (whole KV groups, contiguous copies made outside the timing), each a whole NSA
   on its own CUDA stream, so one part's selected walk can run beside another's compression pass.
   Timed: the whole op, the P parts one after the other on one stream, and the P parts on P streams.
2. G = 4's selected forward: its launch configuration and rows per program, the whole G = 4
   forward and the selected op alone.
3. `pairs` (run 38, at commit f13acbb, which had the kernel; removed after it lost): the "pairs" walk
   of the selected forward at G = 16 (two positions per program, their shared blocks read once)
   against the pipelined one (one position), with its launch configurations.
4. `dims` (run 41): the NSA forward and forward+backward at 64k, 64/4 heads, bf16, at head dims
   128 / 128 (the benchmark's), the paper's 192 / 128 and 256 / 256 (its launches smaller:
   `_triton_utils.wide_rows`). Since run 44 the paper's dims twice: Dk = 192 in two column tiles,
   128 + 64 (`_triton_utils.dk_tiles`, the default), and padded to 256 (`SPLIT_DK = False`, the
   kernels before), and at those dims each branch's op alone, forward and forward+backward.
5. `dims192` (run 45): launch configurations at the paper's 192 / 128 (split): the banded dq and
   dk/dv (compression and window ops, forward+backward), the selected forward (split and padded)
   and the selected dk/dv (the selected op, forward+backward).
6. `dims192b` (run 47): more at 192 / 128, on run 45's launches: banded dk/dv and dq tiles, the
   window forward at 2 stages (its 3 stages need 147,456 bytes of shared memory, one program per SM)
   and the importance kernel's rows and stages (select_blocks).
7. `dims192c` (run 50): the compression's dk/dv at 192 / 128 on run 47's launches (32-key tiles,
   64 queries, 4 warps, 2 stages), which still spills: other stages, query and key tiles.

8. `gates` (run 56): the fused backward with each branch's gate applied inside its kernels
   (`prefill.GATE_IN_BRANCHES`) against the gate backward writing three copies g_x * do: time and
   peak memory of a forward+backward at 64k.

9. `g4steps` (run 109): G = 4's pipelined walk finding each step's block and the positions that
   chose it by one reduction of packed entries (`selection.SELECTED_PACKED_STEP`, the default) or
   by two (before), three rounds in alternation at 8k and 64k.

10. `g4launch` (run 111): on the packed steps, G = 4's TMA launch (`SELECTED_FWD_CONFIG_MULTI_TMA`,
   2 warps and 3 stages, chosen in run 66 before them) against other warps and stages, and 8
   positions a program, two rounds at 8k and 64k.

11. `g4window` (run 112): the kernels of the G = 4 and G = 16 forwards at 64k (torch.profiler), and the window
   branch on its own stream (`prefill.WINDOW_STREAM`, the default) or on the main one, at G = 4 and
   G = 16, three rounds in alternation.

Sections 5-7 ran before the rules they led to (`band._band_config` caps the dq and dk/dv
key tiles at 32 past 128 q/k dims, `selection.selected_fwd_launch` takes 2 warps or more): run again,
rows asking for more keys or 1 warp launch the capped configuration.
"""

import sys
from functools import partial

import torch

from nsa_eval.bench.kernels import (
    _fwd_bwd,
    _inputs,
    _time,
    _with_flag,
    _with_flags,
    block_lists,
    nsa_prefill,
    profile_kernels,
)
from nsa_eval.kernels import _triton_utils, band, importance, prefill, selection
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.importance import select_blocks
from nsa_eval.kernels.selection import selected_attention
from nsa_eval.kernels.window import sliding_window_attention

D = 128


def split_heads(x, parts):
    """The inputs of `parts` independent NSA problems, each whole KV groups of x (contiguous)."""
    hq, hkv = x["q"].shape[2], x["k"].shape[2]
    out = []
    for p in range(parts):
        qs = slice(p * hq // parts, (p + 1) * hq // parts)
        ks = slice(p * hkv // parts, (p + 1) * hkv // parts)
        part = {}
        for name, t in x.items():
            s = qs if name in ("q", "g_cmp", "g_slc", "g_swa") else ks
            part[name] = t.detach()[:, :, s].contiguous().requires_grad_(t.requires_grad)
        out.append(part)
    return out


def on_streams(parts, streams, fn):
    """fn(part) for each part on its own stream; the current stream waits for all of them."""
    main = torch.cuda.current_stream()
    outs = []
    for part, s in zip(parts, streams, strict=True):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(fn(part))
    for s in streams:
        main.wait_stream(s)
    return outs


def probe_overlap(T, hq, hkv):
    x = _inputs(1, T, hq, hkv, D, grad=True)
    print(f"T={T}, {hq}/{hkv} heads:")
    with torch.no_grad():
        whole = _time(lambda: nsa_prefill(**x))
    whole_fb = _time(_fwd_bwd(lambda: nsa_prefill(**x), x))
    print(f"  whole op: fwd {whole:.2f} ms, fwd+bwd {whole_fb:.2f} ms", flush=True)
    for parts in (2, 4):
        if hkv % parts == 0:
            probe_parts(x, parts)
            torch.cuda.empty_cache()


def probe_parts(x, parts):
    T, hq = x["q"].shape[1], x["q"].shape[2]
    xs = split_heads(x, parts)
    streams = [torch.cuda.Stream() for _ in xs]
    with torch.no_grad():
        want = nsa_prefill(**x)
        got = torch.cat(on_streams(xs, streams, lambda p: nsa_prefill(**p)), dim=2)
        torch.cuda.synchronize()
        print(f"  {parts} parts: max |diff| against the whole op {(got - want).abs().max().item():.2e}")
        serial = _time(lambda: [nsa_prefill(**p) for p in xs])
        for window_stream in (True, False):
            t = _with_flag(prefill, "WINDOW_STREAM", window_stream, lambda: _time(
                lambda: on_streams(xs, streams, lambda p: nsa_prefill(**p))))
            print(f"  {parts} parts fwd: one stream {serial:.2f} ms, {parts} streams "
                  f"(window stream {window_stream}) {t:.2f} ms", flush=True)
    grads = [torch.randn(1, T, hq // parts, D, device="cuda", dtype=torch.bfloat16) for _ in xs]
    leaves = [t for p in xs for t in p.values()]

    def fwd_bwd(streamed):
        for t in leaves:
            t.grad = None
        if streamed:
            outs = on_streams(xs, streams, lambda p: nsa_prefill(**p))
        else:
            outs = [nsa_prefill(**p) for p in xs]
        torch.autograd.backward(outs, grads)

    fb_serial = _time(lambda: fwd_bwd(False))
    fb_streams = _time(lambda: fwd_bwd(True))
    print(f"  {parts} parts fwd+bwd: one stream {fb_serial:.2f} ms, {parts} streams {fb_streams:.2f} ms",
          flush=True)


G4_CONFIGS = [
    dict(),
    dict(SELECTED_FWD_CONFIG_MULTI=dict(num_warps=1, num_stages=2)),
    dict(SELECTED_FWD_CONFIG_MULTI=dict(num_warps=1, num_stages=3)),
    dict(SELECTED_FWD_CONFIG_MULTI=dict(num_warps=2, num_stages=3)),
    dict(SELECTED_ROWS=32),
    dict(SELECTED_ROWS=32, SELECTED_FWD_CONFIG_MULTI=dict(num_warps=4, num_stages=2)),
    dict(SELECTED_ROWS=32, SELECTED_FWD_CONFIG_MULTI=dict(num_warps=2, num_stages=3)),
    dict(),
]

G4_TMA_LAUNCHES = [
    dict(),
    *(dict(SELECTED_FWD_CONFIG_MULTI_TMA=dict(num_warps=w, num_stages=n))
      for w, n in ((1, 3), (1, 4), (2, 4), (4, 3), (4, 2))),
    dict(SELECTED_ROWS=32),
]


def with_knobs(knobs, fn):
    return _with_flags(selection, knobs, fn)


def probe_g4(T, hq=16, hkv=4, configs=None):
    x = _inputs(1, T, hq, hkv, D, grad=False)
    idx = block_lists(x)
    with torch.no_grad():
        want = nsa_prefill(**x)
        for knobs in configs or G4_CONFIGS:
            got = with_knobs(knobs, lambda: nsa_prefill(**x))
            err = (got.float() - want.float()).abs().max().item()
            whole = with_knobs(knobs, lambda: _time(lambda: nsa_prefill(**x)))
            sel = with_knobs(knobs, lambda: _time(lambda: selected_attention(x["q"], x["k"], x["v"], idx)))
            print(f"T={T} G=4 {knobs or 'defaults'}: forward {whole:.2f} ms, selected op {sel:.2f} ms, "
                  f"max |diff| {err:.1e}", flush=True)


def _time_forward(x):
    return _time(lambda: nsa_prefill(**x))


def probe_g4_window(T):
    g4 = _inputs(1, T, 16, 4, D, grad=False)
    with torch.no_grad():
        print(f"kernels of the G = 4 forward, T={T}:")
        profile_kernels(lambda: nsa_prefill(**g4), top=12)
        g16 = _inputs(1, T, 64, 4, D, grad=False)
        print(f"kernels of the G = 16 forward, T={T}:")
        profile_kernels(lambda: nsa_prefill(**g16), top=12)
        for _ in range(3):
            for stream in (True, False):
                t4, t16 = (_with_flag(prefill, "WINDOW_STREAM", stream, partial(_time_forward, x))
                           for x in (g4, g16))
                print(f"T={T} window stream {stream}: G = 4 forward {t4:.2f} ms, G = 16 {t16:.2f} ms, "
                      f"per-head ratio {4 * t4 / t16:.3f}", flush=True)


def dims_inputs(T, hq, hkv, dk, dv):
    x = _inputs(1, T, hq, hkv, dk, grad=True)
    if dv != dk:
        for name in ("v", "v_cmp"):
            x[name] = x[name][..., :dv].detach().contiguous().requires_grad_()
    return x


def probe_dims(T, hq=64, hkv=4):
    for dk, dv, split in ((128, 128, True), (192, 128, True), (192, 128, False), (256, 256, True)):
        x = dims_inputs(T, hq, hkv, dk, dv)
        tiles = "split 128 + 64" if dk == 192 and split else "padded to 256" if dk == 192 else "one tile"

        def timed(x=x):
            with torch.no_grad():
                fwd = _time(lambda: nsa_prefill(**x))
            return fwd, _time(_fwd_bwd(lambda: nsa_prefill(**x), x))

        fwd, fwd_bwd = _with_flag(_triton_utils, "SPLIT_DK", split, timed)
        print(f"T={T} {hq}/{hkv} Dk={dk} Dv={dv} ({tiles}): forward {fwd:.2f} ms, forward+backward "
              f"{fwd_bwd:.2f} ms", flush=True)
        del x
        torch.cuda.empty_cache()
    probe_dims_branches(T, hq, hkv)


def probe_dims_branches(T, hq, hkv, dk=192, dv=128):
    """Each branch's op alone at the paper's dims, split and padded, side by side."""
    x = dims_inputs(T, hq, hkv, dk, dv)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    def select():
        return select_blocks(x["q"], x["k_cmp"], lse=lse)

    ops = {
        "compression": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
        "window": lambda: sliding_window_attention(x["q"], x["k"], x["v"]),
        "selected": lambda: selected_attention(x["q"], x["k"], x["v"], idx),
    }
    for split in (True, False):
        times = {}
        with torch.no_grad():
            times["select_blocks fwd"] = _with_flag(_triton_utils, "SPLIT_DK", split, lambda: _time(select))
        for name, fn in ops.items():
            with torch.no_grad():
                times[f"{name} fwd"] = _with_flag(_triton_utils, "SPLIT_DK", split, lambda fn=fn: _time(fn))
            times[f"{name} fwd+bwd"] = _with_flag(_triton_utils, "SPLIT_DK", split,
                                                  lambda fn=fn: _time(_fwd_bwd(fn, x)))
        print(f"T={T} {hq}/{hkv} Dk={dk} Dv={dv} {'split' if split else 'padded'}: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()), flush=True)


def band_variant(branch, part, **changes):
    configs = {b: {p: dict(c) for p, c in parts.items()} for b, parts in band.BAND_CONFIGS.items()}
    configs[branch][part].update(changes)
    return configs


def probe_dims192(T, hq=64, hkv=4, dk=192, dv=128):
    x = dims_inputs(T, hq, hkv, dk, dv)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    ops = {"cmp": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
           "swa": lambda: sliding_window_attention(x["q"], x["k"], x["v"])}
    for branch, fn in ops.items():
        variants = (("dq", {}), ("dq", dict(num_warps=8)), ("dq", dict(BM=32)), ("dkv", dict(num_warps=8)),
                    ("dkv", dict(BN=32)), ("dkv", dict(BN=32, num_warps=2)))
        for part, changes in variants:
            ms = _with_flag(band, "BAND_CONFIGS", band_variant(branch, part, **changes),
                            lambda fn=fn: _time(_fwd_bwd(fn, x)))
            print(f"T={T} Dk={dk} Dv={dv} {branch} fwd+bwd, {part} {changes or 'defaults'}: {ms:.2f} ms",
                  flush=True)

    def selected():
        return selected_attention(x["q"], x["k"], x["v"], idx)

    for split in (True, False):
        for config in (dict(num_warps=1, num_stages=2), dict(num_warps=1, num_stages=3),
                       dict(num_warps=2, num_stages=2), dict(num_warps=4, num_stages=2)):
            with torch.no_grad():
                knobs = {"SELECTED_FWD_CONFIG": config}
                ms = _with_flag(_triton_utils, "SPLIT_DK", split,
                                lambda k=knobs: with_knobs(k, lambda: _time(selected)))
            tiles = "split" if split else "padded"
            print(f"T={T} Dk={dk} Dv={dv} selected fwd, {tiles} {config}: {ms:.2f} ms", flush=True)
    # run 45's dk/dv launches, around the one before run 105 (which SELECTED_DKV_WIDE now replaces)
    for knobs in ({}, {"SELECTED_DKV_ROWS": 32}, {"SELECTED_DKV_CONFIG": dict(num_stages=2)},
                  {"SELECTED_DKV_CONFIG": dict(num_stages=3, num_warps=4)}):
        knobs = {"SELECTED_DKV_WIDE": None, **knobs}
        ms = with_knobs(knobs, lambda: _time(_fwd_bwd(selected, x)))
        print(f"T={T} Dk={dk} Dv={dv} selected fwd+bwd, {knobs or 'defaults'}: {ms:.2f} ms", flush=True)


def probe_dims192b(T, hq=64, hkv=4, dk=192, dv=128):
    x = dims_inputs(T, hq, hkv, dk, dv)
    ops = {"cmp": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
           "swa": lambda: sliding_window_attention(x["q"], x["k"], x["v"])}
    for branch, fn in ops.items():
        variants = (("dkv", {}), ("dkv", dict(num_warps=8)), ("dkv", dict(BM=32)),
                    ("dkv", dict(BM=128, num_warps=8)), ("dq", dict(BN=32)))
        for part, changes in variants:
            ms = _with_flag(band, "BAND_CONFIGS", band_variant(branch, part, **changes),
                            lambda fn=fn: _time(_fwd_bwd(fn, x)))
            print(f"T={T} Dk={dk} Dv={dv} {branch} fwd+bwd, {part} {changes or 'defaults'}: {ms:.2f} ms",
                  flush=True)
        for changes in ({}, dict(num_stages=2)):
            with torch.no_grad():
                ms = _with_flag(band, "BAND_CONFIGS", band_variant(branch, "fwd", **changes),
                                lambda fn=fn: _time(fn))
            print(f"T={T} Dk={dk} Dv={dv} {branch} fwd, {changes or 'defaults'}: {ms:.2f} ms", flush=True)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        for changes in ({}, dict(rows=128), dict(num_stages=2), dict(rows=128, num_stages=2)):
            config = dict(importance.IMPORTANCE_CONFIG)
            config["reshape"] = dict(config["reshape"], **changes)
            ms = _with_flag(importance, "IMPORTANCE_CONFIG", config,
                            lambda: _time(lambda: select_blocks(x["q"], x["k_cmp"], lse=lse)))
            print(f"T={T} Dk={dk} Dv={dv} select_blocks, importance {changes or 'defaults'}: {ms:.2f} ms",
                  flush=True)


def probe_dims192c(T, hq=64, hkv=4, dk=192, dv=128):
    x = dims_inputs(T, hq, hkv, dk, dv)

    def fn():
        return compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0]

    for changes in ({}, dict(num_stages=3), dict(num_stages=1), dict(BM=32), dict(BM=32, num_warps=2),
                    dict(BN=16), dict(BN=16, num_warps=2)):
        ms = _with_flag(band, "BAND_CONFIGS", band_variant("cmp", "dkv", **changes),
                        lambda: _time(_fwd_bwd(fn, x)))
        print(f"T={T} Dk={dk} Dv={dv} cmp fwd+bwd, dkv {changes or 'defaults'}: {ms:.2f} ms", flush=True)


def probe_gates(T):
    """The fused backward with the gates applied in each branch's kernels against the gate backward's
    three copies g_x * do (`prefill.GATE_IN_BRANCHES`), in alternation: forward+backward time and the
    peak memory of one forward+backward, at 64/4 and 16/4 heads and at 192 / 128."""
    for hq, dk, dv in ((64, 128, 128), (16, 128, 128), (64, 192, 128)):
        x = dims_inputs(T, hq, 4, dk, dv)
        step = _fwd_bwd(lambda x=x: nsa_prefill(**x), x)
        for rep in range(3):
            for in_branches in (True, False):
                def measure(step=step):
                    ms = _time(step)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    return ms, (torch.cuda.max_memory_allocated() - base) / 2 ** 30

                ms, gib = _with_flag(prefill, "GATE_IN_BRANCHES", in_branches, measure)
                how = "gates in the branches" if in_branches else "copies g_x * do"
                print(f"[{rep}] T={T} {hq}/4 Dk={dk} Dv={dv} {how}: forward+backward {ms:.2f} ms, peak "
                      f"{gib:.2f} GiB above the inputs", flush=True)
        torch.cuda.empty_cache()


def probe_g4_configs(configs):
    """`probe_g4` over `configs` at 8k and 64k."""
    def run(_T):
        for T in (8192, 65536):
            probe_g4(T, configs=configs)
    return run


# the probes run alone, one per call, each called with T = 64k (the G = 4 configurations time 8k too)
SINGLE_PROBES = {"dims": probe_dims, "dims192": probe_dims192, "dims192b": probe_dims192b,
                 "dims192c": probe_dims192c, "gates": probe_gates, "g4window": probe_g4_window,
                 "g4launch": probe_g4_configs(G4_TMA_LAUNCHES * 2),
                 "g4steps": probe_g4_configs([{}, dict(SELECTED_PACKED_STEP=False)] * 3)}


def main():
    parts = sys.argv[1:] or ["overlap", "g4"]
    if len(parts) == 1 and parts[0] in SINGLE_PROBES:
        SINGLE_PROBES[parts[0]](65536)
        return
    for T in (8192, 65536):
        if "g4" in parts:
            probe_g4(T)
        if "overlap" in parts:
            probe_overlap(T, 64, 4)
            probe_overlap(T, 16, 4)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Kernel benchmark: NSA (Triton, all three branches with gates) against torch SDPA full attention.

Forward, forward+backward and decode times per length, measured in one process with
`triton.testing.do_bench` (median, CUDA events) so every ratio compares numbers from the same run:
- prefill at B=1, 64 query heads, 4 KV heads, d=128, bf16, paper config (l=32, d=16, l'=64, n=16,
  w=512), beside SDPA with the cuDNN and the flash backends;
- flash-linear-attention's `parallel_nsa` where it imports (its own config: mean-pooled 64-token
  compression, no window branch: it needs flash-attn for that);
- a G=4 row (16 query heads, 4 KV heads) in time per query head against G=16;
- both forwards also replayed from a CUDA graph of one call, which costs the host next to nothing:
  where the eager time is above the replay's, the GPU waited for the host to enqueue the launches;
- decode at batch 16 over a cache of T tokens against SDPA decode over the full cache (GQA, no
  KV expansion), both replayed from CUDA graphs;
- without `table_only`, at the longest length: each Triton op timed alone and the kernels of the
  prefill and the decode by device time (torch.profiler, logged).

The NSA prefill is `nsa_eval.kernels.prefill.nsa_attention`, the op that
`nsa_eval.kernels.nsa_attention(impl="triton")` runs.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PAPER = dict(block_len=32, stride=16, select_size=64, num_selected=16, num_init=1, num_local=2, window=512)


@dataclass
class Row:
    case: str  # fwd | fwd+bwd | decode
    impl: str
    T: int
    heads: str  # "Hq/Hkv"
    batch: int
    ms: float | None
    note: str = ""


def nsa_prefill(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, **params):
    """NSA prefill through the Triton kernels (`kernels.prefill`): [B,T,Hq,Dk] ... -> [B,T,Hq,Dv]."""
    from nsa_eval.kernels.prefill import nsa_attention

    return nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, **{**PAPER, **params})


def _inputs(B, T, hq, hkv, d, *, grad, device="cuda", dtype=None):
    import torch

    dtype = dtype or torch.bfloat16
    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    return dict(q=rnd(B, T, hq, d), k=rnd(B, T, hkv, d), v=rnd(B, T, hkv, d), k_cmp=rnd(B, tc, hkv, d),
                v_cmp=rnd(B, tc, hkv, d),
                **{g: torch.rand(B, T, hq, device=device, dtype=dtype).requires_grad_(grad)
                   for g in ("g_cmp", "g_slc", "g_swa")})


MIN_TIMED_CALLS = 5


def timing_window(rep_ms: float, estimate_ms: float, min_calls: int = MIN_TIMED_CALLS) -> float:
    """The `rep` (ms) to give `do_bench` so that it times at least `min_calls` calls of an
    `estimate_ms` function: it times rep / estimate calls, a single one past `rep`, and the median of
    one sample spread the 64k forward+backward over 109.5-113.1 ms in four measurements. The 1.25
    covers do_bench's own estimate, which clears L2 before each call."""
    return max(rep_ms, 1.25 * min_calls * estimate_ms)


def _time(fn, warmup=25, rep=100):
    """Median ms of fn() over at least MIN_TIMED_CALLS calls (CUDA events, L2 cleared between)."""
    import torch
    import triton

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = timing_window(rep, start.elapsed_time(end))
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _time_graph(fn, rep=100):
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def _fwd_bwd(fn, inputs):
    import torch

    leaves = [x for x in inputs.values() if x.requires_grad]
    out = fn()
    do = torch.randn_like(out)

    def step():
        for x in leaves:
            x.grad = None
        fn().backward(do)

    return step


def bench_nsa_prefill(T, hq, hkv, d=128):
    import torch

    x = _inputs(1, T, hq, hkv, d, grad=True)
    fwd = lambda: nsa_prefill(**x)  # noqa: E731
    with torch.no_grad():
        t_fwd = _time(fwd)
    t_fb = _time(_fwd_bwd(fwd, x))
    return t_fwd, t_fb


def cuda_graph_replay(fn):
    """fn's GPU work captured once in a CUDA graph: a callable that replays it (fn is run three times
    on a side stream first, as capture asks, so that everything it compiles or allocates once exists)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_nsa_prefill_graph(T, hq, hkv, d=128):
    """ms of the NSA forward replayed from a CUDA graph (`bench_nsa_prefill`'s forward without the
    host's time to enqueue it)."""
    import torch

    x = _inputs(1, T, hq, hkv, d, grad=False)
    with torch.no_grad():
        replay = cuda_graph_replay(lambda: nsa_prefill(**x))
        return _time(replay)


def bench_sdpa_prefill(T, hq, hkv, d, backend):
    """Full causal attention through SDPA with one backend; KV expanded to Hq heads outside timing."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    q = torch.randn(1, hq, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, hq, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, hq, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = dict(q=q, k=k, v=v)

    def fwd():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        t_fwd = _time(fwd)
    t_fb = _time(_fwd_bwd(fwd, x))
    return t_fwd, t_fb


def bench_fla_prefill(T, hq, hkv, d):
    """fla's parallel_nsa (mean-pooled 64-token compression, 16 blocks of 64, no window branch)."""
    import torch
    from fla.ops.nsa import parallel_nsa

    x = _inputs(1, T, hq, hkv, d, grad=True)
    x.pop("k_cmp")
    x.pop("v_cmp")
    fwd = lambda: parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"],  # noqa: E731
                               block_counts=16, block_size=64, window_size=0)
    with torch.no_grad():
        t_fwd = _time(fwd)
    t_fb = _time(_fwd_bwd(fwd, x))
    return t_fwd, t_fb



def bench_decode(T, batch, hq, hkv, d):
    """NSA decode against SDPA decode over the full cache (flash and cuDNN), all replayed from CUDA
    graphs, and NSA's plain launches: {"nsa", "nsa_nograph", "flash", "cudnn"} ms (None, and a
    "<backend>_error" line, where an SDPA backend fails)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa_eval.kernels.decode import nsa_decode

    q, k, v, k_cmp, v_cmp, gates = _decode_inputs(T, batch, hq, hkv, d)
    seqlens = torch.full((batch,), T, device="cuda", dtype=torch.int32)
    nsa = lambda: nsa_decode(q, k, v, k_cmp, v_cmp, *gates, cache_seqlens=seqlens)  # noqa: E731
    out = {"nsa": _time_graph(nsa), "nsa_nograph": _time(nsa)}
    qt = q.transpose(1, 2)  # [B, Hq, 1, d]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, d] views
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            sdpa()
            out[name] = _time_graph(sdpa)
        except Exception as err:  # a backend may not take GQA or this layout
            out[name] = None
            out[name + "_error"] = str(err).splitlines()[0][:120]
    return out


def _decode_inputs(T, batch, hq, hkv, d):
    """Random bf16 decode inputs on the GPU: q [B, 1, Hq, d], caches k, v [B, T, Hkv, d] and k_cmp,
    v_cmp [B, Tc, Hkv, d] (the paper's compression), three gates [B, 1, Hq]."""
    import torch

    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    gates = [torch.rand(batch, 1, hq, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return rnd(batch, 1, hq, d), rnd(batch, T, hkv, d), rnd(batch, T, hkv, d), rnd(batch, tc, hkv, d), \
        rnd(batch, tc, hkv, d), gates


def bench_ops(T, hq, hkv, d=128):
    """Forward and forward+backward time of each Triton op alone (where the time goes):
    {op: (fwd ms, fwd+bwd ms or None)}."""
    import torch

    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.importance import select_blocks
    from nsa_eval.kernels.selection import selected_attention
    from nsa_eval.kernels.window import sliding_window_attention

    x = _inputs(1, T, hq, hkv, d, grad=True)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
    ops = {
        "compressed_attention": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
        "selected_attention": lambda: selected_attention(x["q"], x["k"], x["v"], idx),
        "sliding_window_attention": lambda: sliding_window_attention(x["q"], x["k"], x["v"]),
    }
    out = {}
    with torch.no_grad():
        out["select_blocks"] = (_time(lambda: select_blocks(x["q"], x["k_cmp"], lse=lse)), None)
        for name, fn in ops.items():
            out[name] = (_time(fn),)
    for name, fn in ops.items():
        out[name] += (_time(_fwd_bwd(fn, x)),)
    return out


def profile_kernels(fn, log=print, iters=3, top=14):
    """Log the GPU kernels `fn` launches, by total device time per call (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)  # noqa: E731
    for e in sorted(events, key=device_us, reverse=True)[:top]:
        log(f"    {e.key[:70]:70s} {device_us(e) / iters / 1000:9.3f} ms/call  x{e.count // iters}")


def profile_prefill(T, hq, hkv, d, log=print, g4_heads=None):
    """Per-kernel breakdown of the NSA prefill fwd+bwd at length T; with g4_heads (hq, hkv), also of
    that forward alone."""
    import torch

    x = _inputs(1, T, hq, hkv, d, grad=True)
    log(f"kernels of NSA prefill forward+backward, T={T}:")
    profile_kernels(_fwd_bwd(lambda: nsa_prefill(**x), x), log)
    if g4_heads:
        x = _inputs(1, T, *g4_heads, d, grad=False)
        log(f"kernels of NSA prefill forward, T={T}, {g4_heads[0]}/{g4_heads[1]} heads:")
        with torch.no_grad():
            profile_kernels(lambda: nsa_prefill(**x), log, top=10)


def profile_decode(T, hq, hkv, d, batch, log=print):
    """Per-kernel breakdown of the NSA decode (plain launches) over a cache of T tokens."""
    from nsa_eval.kernels.decode import nsa_decode

    q, k, v, k_cmp, v_cmp, gates = _decode_inputs(T, batch, hq, hkv, d)
    log(f"kernels of NSA decode, B={batch}, T={T} (plain launches):")
    profile_kernels(lambda: nsa_decode(q, k, v, k_cmp, v_cmp, *gates), log, iters=20, top=5)


@dataclass(frozen=True)
class Timers:
    """The measurements `run_kernel_benchmark` takes, each a function of the benchmark's shapes (see
    each default); a test passes stand-ins where no GPU is at hand."""

    nsa_prefill: Callable = bench_nsa_prefill
    nsa_prefill_graph: Callable = bench_nsa_prefill_graph
    sdpa_prefill: Callable = bench_sdpa_prefill
    fla_prefill: Callable = bench_fla_prefill
    decode: Callable = bench_decode
    ops: Callable = bench_ops
    profile_prefill: Callable = profile_prefill
    profile_decode: Callable = profile_decode


def run_kernel_benchmark(lengths=(8192, 16384, 32768, 65536), *, heads=64, kv_heads=4, dim=128,
                         decode_batch=16, g4_heads=(16, 4), fla=True, table_only=False, log=print,
                         timers: Timers = Timers()) -> list[Row]:
    """Measure everything; returns one Row per (case, impl, T). `table_only`: the report's tables
    alone (NSA, SDPA, fla, G=4, graph replays, decode), without the per-kernel profiles and the ops
    timed alone at the longest length."""
    import torch

    rows: list[Row] = []
    hs = f"{heads}/{kv_heads}"
    g4 = f"{g4_heads[0]}/{g4_heads[1]}"
    has_fla = False
    if fla:
        try:
            import fla.ops.nsa  # noqa: F401

            has_fla = True
        except Exception as err:  # not installed, or its import fails
            log(f"fla parallel_nsa not importable: {err}")

    def add(case, impl, T, heads_str, batch, ms, note=""):
        rows.append(Row(case, impl, T, heads_str, batch, None if ms is None else round(ms, 4), note))
        log(f"{case:8s} {impl:22s} T={T:6d} {heads_str:6s} B={batch:<3d} "
            f"{'n/a' if ms is None else f'{ms:9.3f} ms'} {note}")

    def guarded(what, T, measure, *args):
        # a baseline that fails (an SDPA backend, fla) leaves n/a in the tables, not a failed run
        try:
            return measure(*args)
        except Exception as err:
            log(f"{what} failed at T={T}: {str(err).splitlines()[0][:160]}")
            return None, None

    for T in lengths:
        t_fwd, t_fb = timers.nsa_prefill(T, heads, kv_heads, dim)
        add("fwd", "nsa-triton", T, hs, 1, t_fwd)
        add("fwd+bwd", "nsa-triton", T, hs, 1, t_fb)
        for backend in ("cudnn", "flash"):
            f, fb = guarded(f"sdpa {backend}", T, timers.sdpa_prefill, T, heads, kv_heads, dim, backend)
            add("fwd", f"sdpa-{backend}", T, hs, 1, f)
            add("fwd+bwd", f"sdpa-{backend}", T, hs, 1, fb)
        if has_fla:
            f, fb = guarded("fla", T, timers.fla_prefill, T, heads, kv_heads, dim)
            add("fwd", "fla-parallel_nsa", T, hs, 1, f, "no window branch, mean-pool l=d=64")
            add("fwd+bwd", "fla-parallel_nsa", T, hs, 1, fb, "no window branch, mean-pool l=d=64")
        f, fb = timers.nsa_prefill(T, g4_heads[0], g4_heads[1], dim)
        add("fwd", "nsa-triton", T, g4, 1, f)
        add("fwd+bwd", "nsa-triton", T, g4, 1, fb)
        for (hq, hkv), heads_str in (((heads, kv_heads), hs), (g4_heads, g4)):
            add("fwd", "nsa-triton-graph", T, heads_str, 1, timers.nsa_prefill_graph(T, hq, hkv, dim),
                "replayed from a CUDA graph")
            torch.cuda.empty_cache()  # the graph's private memory
        dec = timers.decode(T, decode_batch, heads, kv_heads, dim)
        add("decode", "nsa-triton", T, hs, decode_batch, dec["nsa"], "CUDA graph")
        add("decode", "nsa-triton-nograph", T, hs, decode_batch, dec["nsa_nograph"], "plain launches")
        for name in ("flash", "cudnn"):
            note = dec.get(name + "_error", "CUDA graph")
            add("decode", f"sdpa-{name}", T, hs, decode_batch, dec[name], note)
        torch.cuda.empty_cache()
    if table_only:
        return rows
    T = max(lengths)
    try:
        timers.profile_prefill(T, heads, kv_heads, dim, log, g4_heads=g4_heads)
        timers.profile_decode(T, heads, kv_heads, dim, decode_batch, log)
    except Exception as err:  # the profiler is optional
        log(f"profiling failed: {str(err).splitlines()[0][:160]}")
    torch.cuda.empty_cache()
    for name, (f, *fb) in timers.ops(T, heads, kv_heads, dim).items():
        add("op-fwd", name, T, hs, 1, f)
        if fb and fb[0] is not None:
            add("op-fwd+bwd", name, T, hs, 1, fb[0])
    return rows


def _get(rows, case, impl, T, heads=None):
    for r in rows:
        if r.case == case and r.impl == impl and r.T == T and (heads is None or r.heads == heads):
            return r.ms
    return None


def _ratio(a, b):
    return None if a is None or b is None or a == 0 else b / a


def _fmt(x, digits=2):
    if x is None:
        return "n/a"
    return f"{x:.{digits}f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3f}"


def software_versions() -> str:
    """The GPU and the torch / Triton versions a benchmark ran with: the kernels' speed depends on
    Triton's code generation (the 64k forward+backward took 116.5 ms with Triton 3.6 and 110.4-112.6
    with 3.8 on one H200)."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}, torch {torch.__version__}, Triton {triton.__version__}"


def markdown_report(rows, *, heads=64, kv_heads=4, g4_heads=(16, 4), command="", versions="") -> str:
    hs = f"{heads}/{kv_heads}"
    g4 = f"{g4_heads[0]}/{g4_heads[1]}"
    lengths = sorted({r.T for r in rows})
    lines = ["# NSA kernel benchmark", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    if versions:
        lines += [f"Ran on: {versions}", ""]
    lines += [
        f"B=1, {heads} query heads, {kv_heads} KV heads, d=128, bf16, paper config (l=32, d=16, l'=64, n=16, "
        "w=512), all three branches and gates; median ms of at least 5 calls from `triton.testing.do_bench`. "
        "Speed-up = SDPA time / NSA time (higher is better).",
        "",
        "| T | NSA fwd | cuDNN fwd | flash fwd | vs cuDNN | vs flash | NSA fwd+bwd | cuDNN fwd+bwd | "
        "flash fwd+bwd | vs cuDNN | vs flash |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for T in lengths:
        f = [_get(rows, "fwd", i, T, hs) for i in ("nsa-triton", "sdpa-cudnn", "sdpa-flash")]
        b = [_get(rows, "fwd+bwd", i, T, hs) for i in ("nsa-triton", "sdpa-cudnn", "sdpa-flash")]
        lines.append(f"| {T} | " + " | ".join(_fmt(x) for x in f) + f" | {_fmt(_ratio(f[0], f[1]))}x | "
                     f"{_fmt(_ratio(f[0], f[2]))}x | " + " | ".join(_fmt(x) for x in b)
                     + f" | {_fmt(_ratio(b[0], b[1]))}x | {_fmt(_ratio(b[0], b[2]))}x |")
    if any(r.impl == "fla-parallel_nsa" for r in rows):
        lines += ["", "flash-linear-attention 0.6.0 `parallel_nsa` (same heads; its own config: mean-pooled "
                  "64-token compression, no window branch):", "",
                  "| T | fla fwd | fla fwd+bwd | NSA-triton fwd speed-up vs fla | fwd+bwd speed-up |",
                  "|---|---|---|---|---|"]
        for T in lengths:
            ff, fb = _get(rows, "fwd", "fla-parallel_nsa", T), _get(rows, "fwd+bwd", "fla-parallel_nsa", T)
            nf, nb = _get(rows, "fwd", "nsa-triton", T, hs), _get(rows, "fwd+bwd", "nsa-triton", T, hs)
            lines.append(f"| {T} | {_fmt(ff)} | {_fmt(fb)} | {_fmt(_ratio(nf, ff))}x | "
                         f"{_fmt(_ratio(nb, fb))}x |")
    lines += ["", f"GQA group size: G=4 ({g4} heads) against G=16 ({hs}), time per query head "
              "(ratio > 1: G=4 slower per head).", "",
              "| T | G=4 fwd | G=16 fwd | per-head ratio fwd | G=4 fwd+bwd | G=16 fwd+bwd | "
              "per-head ratio fwd+bwd |",
              "|---|---|---|---|---|---|---|"]
    for T in lengths:
        a, b = _get(rows, "fwd", "nsa-triton", T, g4), _get(rows, "fwd", "nsa-triton", T, hs)
        c, d = _get(rows, "fwd+bwd", "nsa-triton", T, g4), _get(rows, "fwd+bwd", "nsa-triton", T, hs)
        per = lambda x, n: None if x is None else x / n  # noqa: E731
        ra = _ratio(per(b, heads), per(a, g4_heads[0]))
        rc = _ratio(per(d, heads), per(c, g4_heads[0]))
        lines.append(f"| {T} | {_fmt(a)} | {_fmt(b)} | {_fmt(ra)} | {_fmt(c)} | {_fmt(d)} | {_fmt(rc)} |")
    if any(r.impl == "nsa-triton-graph" for r in rows):
        lines += ["", "The same forwards replayed from a CUDA graph of one call, with next to no host time: "
                  "where the eager time is above the replay's, the GPU waited for the host.", "",
                  "| T | G=16 fwd | G=16 fwd, graph | G=4 fwd | G=4 fwd, graph | "
                  "per-head ratio fwd, graphs |", "|---|---|---|---|---|---|"]
        for T in lengths:
            b, bg = _get(rows, "fwd", "nsa-triton", T, hs), _get(rows, "fwd", "nsa-triton-graph", T, hs)
            a, ag = _get(rows, "fwd", "nsa-triton", T, g4), _get(rows, "fwd", "nsa-triton-graph", T, g4)
            rg = _ratio(None if bg is None else bg / heads, None if ag is None else ag / g4_heads[0])
            lines.append(f"| {T} | {_fmt(b)} | {_fmt(bg)} | {_fmt(a)} | {_fmt(ag)} | {_fmt(rg)} |")
    batch = next((r.batch for r in rows if r.case == "decode"), 16)
    lines += ["", f"Decode, batch {batch}, one new token against a cache of T tokens ({hs} heads), "
              "CUDA graphs; SDPA reads the full cache (GQA, no expansion).", "",
              "| T | NSA decode | NSA (plain launches) | SDPA flash | SDPA cuDNN | speed-up vs flash | "
              "speed-up vs cuDNN |", "|---|---|---|---|---|---|---|"]
    for T in lengths:
        n, p = _get(rows, "decode", "nsa-triton", T), _get(rows, "decode", "nsa-triton-nograph", T)
        fl, cu = _get(rows, "decode", "sdpa-flash", T), _get(rows, "decode", "sdpa-cudnn", T)
        lines.append(f"| {T} | {_fmt(n, 3)} | {_fmt(p, 3)} | {_fmt(fl, 3)} | {_fmt(cu, 3)} | "
                     f"{_fmt(_ratio(n, fl))}x | {_fmt(_ratio(n, cu))}x |")
    ops = [r for r in rows if r.case.startswith("op-")]
    if ops:
        lines += ["", f"Where the time goes: each Triton op alone at T={ops[0].T} ({hs} heads), ms.", "",
                  "| op | fwd | fwd+bwd |", "|---|---|---|"]
        for name in dict.fromkeys(r.impl for r in ops):
            lines.append(f"| {name} | {_fmt(_get(rows, 'op-fwd', name, ops[0].T))} | "
                         f"{_fmt(_get(rows, 'op-fwd+bwd', name, ops[0].T))} |")
    notes = sorted({f"{r.impl}: {r.note}" for r in rows if r.note and "error" in r.note.lower()})
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_outputs(rows, out_dir, *, command="", **kw) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / "kernels.csv", out / "kernels.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "impl", "T", "heads", "batch", "ms", "note"])
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    md_path.write_text(markdown_report(rows, command=command, versions=software_versions(), **kw))
    return csv_path, md_path


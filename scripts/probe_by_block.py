"""The selected forward per key block (`selected_by_block`) against the position-major walk, side by
side on one GPU (run 115 on the H200).

    PYTHONPATH=. python3 scripts/probe_by_block.py [compare] [launch] [profile] [accuracy] [index] [host]
        [sync] [gate] [gate-backward] [host-stages] [bench-order] [launches] [graph]

(default: compare)

- `compare`: at 8k-64k for 16/4 heads (G = 4) and at 64k also for 32/4 (G = 8), the selected op's
  forward both ways (the walk: `selection.SELECTED_BY_BLOCK_MAX_GROUP = 0`; per block with float32 partials
  and with partials in the inputs' dtype), the largest differences of o and lse from the walk, the peak
  memory above the inputs, then the whole NSA forward at G = 4 and G = 16 both ways (by block: the
  defaults, G = 16 keeps the walk), two rounds in alternation, with the per-head ratio the benchmark
  reports (4 x G = 4's time / G = 16's).
- `launch`: the block-major kernel's rows per MMA, positions per work item, warps and stages, and the
  merge's warps, G = 4 at 64k and 8k.
- `profile`: the kernels of the G = 4 forward per block at 64k and 8k (torch.profiler).
- `accuracy`: the selected op's bf16 outputs both ways against the float32 reference at 8k.
- `index`: the forward per block with the counting index (`block_entries`) against the sorted one
  (`inverted_index`) and the walk, at 8k-64k: the selected op, then the NSA forward at G = 4 (per
  block at every length) beside G = 16's, two rounds, with the host's time to enqueue one forward
  (the GPU held busy meanwhile) beside its GPU time; then the kernels of G = 4's forward at 8k. The
  op also with one counter a block (`selected_by_block.INDEX_SPREAD = 1`).
- `host`: where the host's time to enqueue G = 4's forward at 8k goes (cProfile over 50 calls while
  the GPU is busy, so that no launch waits).
- `sync`: the operations that make the host wait for the GPU in the sorted index (`inverted_index`),
  the counting one and G = 4's forward+backward at 8k: those `torch.cuda.set_sync_debug_mode` names
  (none in run 121), then, from torch.profiler's host trace with the GPU held busy, the CUDA runtime
  calls that took over 1 ms on the host and the torch ops they ran under.
- `gate`: where NSA's gated sum is computed (`prefill.GATE_IN_SELECTED`: a pass of its own, the merge
  of the forward per key block, every selected forward's epilogue), the NSA forward at G = 4 and
  G = 16 at 8k-64k, three rounds in alternation, with the per-head ratio; the forward+backward at 8k,
  16k and 64k, G = 4 and G = 16, apart and "auto" (also alone: `gate-backward`); then the
  block-major kernel's positions per work item at 8k and 64k, and the kernels of G = 4's forward at
  8k with the defaults.
- `host-stages`: the host's time to enqueue each stage of G = 4's forward at 8k (the GPU held busy,
  no profiler), beside the whole forward's and one `torch.empty`'s.
- `bench-order`: G = 4's forward at 8k timed as the benchmark times it (`bench.bench_nsa_prefill`), alone,
  then after the benchmark's G = 16 and SDPA rows at 8k, then after a garbage collection and
  `empty_cache`, each with the host's time to enqueue one forward.
- `launches`: the host's time to enqueue G = 4's forward at 8k with and without direct launches
  (`_triton_utils.DIRECT_LAUNCH`), medians of 100 interleaved calls in three rounds; then each of its
  Triton launches (recorded from one forward through Triton's path), re-enqueued three ways with the
  GPU held busy: through Triton's `JITFunction.run` (what `kernel[grid](...)` does), its argument
  binder alone, and the compiled kernel's launcher called directly; beside the whole forward's host
  time, one `TensorDescriptor`, one `torch.empty`, and `triton.cdiv` against plain integer division.
- `graph`: the NSA forward at 8k, G = 4 and G = 16, timed as the benchmark times it (`bench._time`:
  `do_bench`, L2 cleared before each call) eagerly and replayed from a CUDA graph of one call (the
  same kernels, nearly no host time), three rounds in alternation: where the eager time exceeds the
  replay's, the GPU waited for the host. Also the allocator's new segments (`cudaMalloc`) while the
  host enqueues 50 eager forwards with the GPU held busy.
"""

import functools
import sys
import time

import torch

from nsa_eval.bench.kernels import (
    _fwd_bwd,
    _inputs,
    _time,
    _with_flags,
    block_lists,
    cuda_graph_replay,
    nsa_prefill,
    profile_kernels,
)
from nsa_eval.kernels import _triton_utils, prefill, selected_by_block, selection
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.importance import select_blocks

D = 128
WALK = dict(SELECTED_BY_BLOCK_MAX_GROUP=0)
BY_BLOCK = dict(SELECTED_BY_BLOCK_MAX_GROUP=16, SELECTED_BY_BLOCK_MIN_ROWS=0)


def _selected(x, idx, knobs, partials="float32", index="count"):
    def run():
        return selection.selected_forward(x["q"], x["k"], x["v"], idx, select_size=64, scale=D**-0.5,
                                          presorted=True)
    return lambda: _with_flags(selected_by_block, dict(BY_BLOCK_PARTIALS=partials, BY_BLOCK_INDEX=index),
                               lambda: _with_flags(selection, knobs, run))


def _peak_gib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def compare_op(T, hq):
    x = _inputs(1, T, hq, 4, D, grad=False)
    with torch.no_grad():
        idx = block_lists(x)
        o_w, lse_w = _selected(x, idx, WALK)()
        line = [f"T={T} {hq}/4: walk {_time(_selected(x, idx, WALK)):.3f} ms"]
        for partials in ("float32", "input"):
            fn = _selected(x, idx, BY_BLOCK, partials)
            o_b, lse_b = fn()
            do = (o_b.float() - o_w.float()).abs().max().item()
            dl = (lse_b - lse_w).abs().max().item()
            line.append(f"by block ({partials}) {_time(fn):.3f} ms, max |do| {do:.1e}, |dlse| {dl:.1e}, "
                        f"peak {_peak_gib(fn):.2f} GiB")
        print("; ".join(line) + f" (walk {_peak_gib(_selected(x, idx, WALK)):.2f})", flush=True)


def compare_forward(T, rounds):
    g4 = _inputs(1, T, 16, 4, D, grad=False)
    g16 = _inputs(1, T, 64, 4, D, grad=False)
    with torch.no_grad():
        for _ in range(rounds):
            for name, knobs in (("walk", WALK), ("defaults", {})):
                t4, t16 = (_with_flags(selection, knobs, lambda x=x: _time(lambda: nsa_prefill(**x)))
                           for x in (g4, g16))
                print(f"T={T} NSA forward, {name}: G = 4 {t4:.2f} ms, G = 16 {t16:.2f} ms, per-head "
                      f"ratio {4 * t4 / t16:.3f}", flush=True)


def compare():
    for T in (8192, 16384, 32768, 65536):
        for hq in (16, 32) if T == 65536 else (16,):
            compare_op(T, hq)
            torch.cuda.empty_cache()
        compare_forward(T, 2)
        torch.cuda.empty_cache()


LAUNCHES = [{}] + [dict(BY_BLOCK_ROWS=r) for r in (32, 128)] + [
    dict(BY_BLOCK_CHUNK_STEPS=c) for c in (4, 64)] + [
    dict(BY_BLOCK_CONFIG=dict(num_warps=w, num_stages=s)) for w, s in ((4, 2), (8, 3), (8, 2), (4, 4))] + [
    dict(MERGE_CONFIG=dict(num_warps=w, num_stages=1)) for w in (2, 8)]


def launch():
    for T in (65536, 8192):
        x = _inputs(1, T, 16, 4, D, grad=False)
        with torch.no_grad():
            idx = block_lists(x)
            fn = _selected(x, idx, BY_BLOCK)
            for knobs in LAUNCHES:
                ms = _with_flags(selected_by_block, knobs, lambda fn=fn: _time(fn))
                print(f"T={T} 16/4 by block {knobs or 'defaults'}: {ms:.3f} ms", flush=True)


def profile():
    for T in (65536, 8192):
        x = _inputs(1, T, 16, 4, D, grad=False)
        with torch.no_grad():
            print(f"kernels of the G = 4 forward per block, T={T}:")
            _with_flags(selection, BY_BLOCK, lambda x=x: profile_kernels(lambda: nsa_prefill(**x), top=8))


def accuracy():
    """rel. error (||a - b|| / ||b||) and max |a - b| of the bf16 outputs against the float32 reference
    at 8k, 16/4 heads: the walk and the forward per block with each partials' dtype."""
    from nsa_eval.kernels import reference as ref

    x = _inputs(1, 8192, 16, 4, D, grad=False)
    with torch.no_grad():
        idx = block_lists(x)
        want = ref.selected_attention(x["q"].float(), x["k"].float(), x["v"].float(), idx, select_size=64)
        ways = (("walk", _selected(x, idx, WALK)),
                ("by block, float32 partials", _selected(x, idx, BY_BLOCK)),
                ("by block, bf16 partials", _selected(x, idx, BY_BLOCK, "input")))
        for name, fn in ways:
            diff = fn()[0].float() - want
            print(f"T=8192 16/4 {name}: rel. error {(diff.norm() / want.norm()).item():.3e}, max |diff| "
                  f"{diff.abs().max().item():.2e}", flush=True)


def _host_ms(fn, calls=20):
    """ms the host takes to enqueue one fn() while the GPU is busy with an earlier spin, so that no
    launch waits for the GPU. The calls run twice and the second round is timed: in the first, memory
    that a call's side stream used is not free again until the GPU gets there, so each call takes new
    segments from the driver (run 128: 61 `cudaMalloc`s in 51 forwards at 8k, G = 4), which no timed
    call in the benchmark does once it is warm. Runs before 128 timed the first round."""
    fn()
    for _round in range(2):  # the second is timed
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time, longer than the calls take to enqueue
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


INDEX_WAYS = (("walk", WALK, "count"), ("by block, sorted index", BY_BLOCK, "sort"),
              ("by block, counting index", BY_BLOCK, "count"))


def _nsa_forward(x, knobs, way):
    return lambda: _with_flags(selected_by_block, dict(BY_BLOCK_INDEX=way),
                               lambda: _with_flags(selection, knobs, lambda: nsa_prefill(**x)))


def index_at(T):
    x = _inputs(1, T, 16, 4, D, grad=False)
    g16 = _inputs(1, T, 64, 4, D, grad=False)
    with torch.no_grad():
        idx = block_lists(x)
        ops = [_selected(x, idx, knobs, "input", way) for _, knobs, way in INDEX_WAYS]
        same = all(torch.equal(a, b) for a, b in zip(ops[1](), ops[2](), strict=True))
        names = [name for name, _, _ in INDEX_WAYS]
        times = ", ".join(f"{name} {_time(fn):.3f} ms" for name, fn in zip(names, ops, strict=True))
        print(f"T={T} 16/4 the op: {times}; o, lse bit-identical between the indexes: {same}", flush=True)
        one = _time(lambda: _with_flags(selected_by_block, dict(INDEX_SPREAD=1), ops[2]))
        print(f"T={T} 16/4 the op, counting index with one counter a block: {one:.3f} ms", flush=True)
        t16 = _time(lambda: nsa_prefill(**g16))
        for r in range(2):
            for name, knobs, way in INDEX_WAYS:
                fn = _nsa_forward(x, knobs, way)
                t4 = _time(fn)
                host = f", host {_host_ms(fn):.3f} ms a call" if r == 0 else ""
                print(f"T={T} NSA forward G = 4, {name}: {t4:.3f} ms{host}, per-head ratio "
                      f"{4 * t4 / t16:.3f} (G = 16 {t16:.2f} ms)", flush=True)
        fn = _nsa_forward(g16, {}, "count")
        print(f"T={T} NSA forward G = 16 (defaults): {_time(fn):.3f} ms, host {_host_ms(fn):.3f} ms a call",
              flush=True)


def index():
    for T in (8192, 16384, 32768, 65536):
        index_at(T)
        torch.cuda.empty_cache()
    x = _inputs(1, 8192, 16, 4, D, grad=False)
    with torch.no_grad():
        print("kernels of the G = 4 forward per block (counting index), T=8192:")
        _with_flags(selection, BY_BLOCK, lambda: profile_kernels(lambda: nsa_prefill(**x), top=12))


def host():
    import cProfile
    import pstats

    x = _inputs(1, 8192, 16, 4, D, grad=False)
    with torch.no_grad():
        fn = _nsa_forward(x, {}, "count")
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time, longer than the calls take to enqueue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    print("host time of G = 4's forward at 8k, 50 calls (cProfile):")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)


def _syncs(name, fn):
    """Print the synchronizing operations of fn() (its second call) and where they are called."""
    import warnings
    from collections import Counter

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"{name}: {len(caught)} synchronizing operations", flush=True)
    for where, count in Counter(f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}"
                                for w in caught).items():
        print(f"  {count} x {where}", flush=True)


def _slow_runtime_calls(name, fn, slower_ms=1.0):
    """Print the CUDA runtime calls of fn() (the GPU busy beforehand) that took the host over
    `slower_ms`, each with the chain of torch ops it ran under: those calls waited for the GPU."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        fn()
        torch.cuda.synchronize()
    # the probe's own synchronize at the end runs under no torch op
    slow = [e for e in prof.events() if e.name.startswith("cu") and e.cpu_time_total > slower_ms * 1e3
            and (e.cpu_parent is not None or e.name != "cudaDeviceSynchronize")]
    print(f"{name}: {len(slow)} runtime calls over {slower_ms} ms on the host", flush=True)
    for e in slow:
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        print(f"  {e.name} {e.cpu_time_total / 1e3:.1f} ms under {' <- '.join(chain) or 'no op'}", flush=True)


def sync():
    x = _inputs(1, 8192, 16, 4, D, grad=True)
    idx = block_lists(x)

    def train_step():
        nsa_prefill(**x).float().square().mean().backward()

    cases = (("inverted_index, 8k, 16/4 heads",
              lambda: selected_by_block.inverted_index(idx, select_size=64, chunk=64, presorted=True)),
             ("block_entries, 8k, 16/4 heads",
              lambda: selected_by_block.block_entries(idx, select_size=64, chunk=64)),
             ("G = 4's forward+backward at 8k", train_step))
    for name, fn in cases:
        _syncs(name, fn)
    for name, fn in cases:
        _slow_runtime_calls(name, fn)


GATE_WAYS = (("apart", False), ("in the merge", "by block"), ("in every selected forward", True))


def gate_backward():
    for T in (8192, 16384, 65536):
        for hq in (16, 64):
            x = _inputs(1, T, hq, 4, D, grad=True)
            step = _fwd_bwd(lambda x=x: nsa_prefill(**x), x)
            for r in range(2):
                for name, way in (("apart", False), ("auto", "auto")):
                    ms = _with_flags(prefill, dict(GATE_IN_SELECTED=way), lambda step=step: _time(step))
                    print(f"T={T} round {r} {hq}/4 heads forward+backward, gated sum {name}: {ms:.3f} ms",
                          flush=True)
            del x, step
            torch.cuda.empty_cache()


def gate():
    for T in (8192, 16384, 32768, 65536):
        g4, g16 = (_inputs(1, T, hq, 4, D, grad=False) for hq in (16, 64))
        with torch.no_grad():
            for r in range(3):
                for name, way in GATE_WAYS:
                    t4, t16 = (_with_flags(prefill, dict(GATE_IN_SELECTED=way),
                                           lambda x=x: _time(lambda: nsa_prefill(**x))) for x in (g4, g16))
                    print(f"T={T} round {r} NSA forward, gated sum {name}: G = 4 {t4:.3f} ms, G = 16 "
                          f"{t16:.3f} ms, per-head ratio {4 * t4 / t16:.3f}", flush=True)
        del g4, g16
        torch.cuda.empty_cache()
    gate_backward()
    for T in (8192, 65536):
        x = _inputs(1, T, 16, 4, D, grad=False)
        with torch.no_grad():
            for steps in (16, 32, 64, 16):
                ms = _with_flags(selected_by_block, dict(BY_BLOCK_CHUNK_STEPS=steps),
                                 lambda x=x: _time(lambda: nsa_prefill(**x)))
                print(f"T={T} G = 4 NSA forward, {steps} steps a work item: {ms:.3f} ms", flush=True)
    x = _inputs(1, 8192, 16, 4, D, grad=False)
    with torch.no_grad():
        print("kernels of the G = 4 forward (defaults), T=8192:")
        profile_kernels(lambda: nsa_prefill(**x), top=12)


def host_stages():
    from nsa_eval.kernels.band import band_forward
    from nsa_eval.kernels.gates import gate_forward

    x = _inputs(1, 8192, 16, 4, D, grad=False)
    q, k_cmp, v_cmp, scale = x["q"], x["k_cmp"], x["v_cmp"], D**-0.5
    with torch.no_grad():
        o, lse = compressed_attention(q, k_cmp, v_cmp)
        idx = select_blocks(q, k_cmp, lse=lse)
        chunk = 16 * selected_by_block.BY_BLOCK_CHUNK_STEPS
        stages = {
            "compression forward (band_forward)": lambda: band_forward(q, k_cmp, v_cmp, scale=scale,
                                                                       key_stride=16, key_offset=31),
            "window forward (band_forward)": lambda: band_forward(q, x["k"], x["v"], scale=scale,
                                                                  key_stride=1, key_offset=0, window=512),
            "select_blocks": lambda: select_blocks(q, k_cmp, lse=lse),
            "block_entries (counting index)": lambda: selected_by_block.block_entries(idx, select_size=64,
                                                                                      chunk=chunk),
            "selected forward per block (index, kernel, merge)": _selected(x, idx, BY_BLOCK, "input"),
            "gate_forward": lambda: gate_forward(o, o, o, x["g_cmp"], x["g_slc"], x["g_swa"]),
            "the NSA forward": lambda: nsa_prefill(**x),
            "torch.empty (one)": lambda: torch.empty(1024, device="cuda"),
        }
        for name, fn in stages.items():
            us = _host_ms(fn, 50) * 1e3
            print(f"T=8192 16/4 heads host time of {name}: {us:.1f} us a call", flush=True)
        print(f"(the NSA forward's GPU time: {_time(stages['the NSA forward']):.3f} ms)", flush=True)


def bench_order():
    import gc

    from nsa_eval.bench.kernels import bench_nsa_prefill, bench_sdpa_prefill

    def g4(label):
        x = _inputs(1, 8192, 16, 4, D, grad=True)
        with torch.no_grad():
            host = _host_ms(lambda: nsa_prefill(**x), 50) * 1e3
        fwd, fwd_bwd = bench_nsa_prefill(8192, 16, 4, D)
        print(f"T=8192 16/4 heads {label}: forward {fwd:.3f} ms, forward+backward {fwd_bwd:.3f} ms, host "
              f"{host:.0f} us a forward", flush=True)

    g4("alone")
    g4("alone, again")
    print(f"T=8192 64/4 heads: {bench_nsa_prefill(8192, 64, 4, D)}", flush=True)
    for backend in ("cudnn", "flash"):
        print(f"T=8192 SDPA {backend}: {bench_sdpa_prefill(8192, 64, 4, D, backend)}", flush=True)
    g4("after G = 16 and SDPA")
    gc.collect()
    torch.cuda.empty_cache()
    g4("after gc.collect and empty_cache")


def _host_interleaved_us(fns, calls):
    """Median us the host takes to enqueue each of fns, called in turn `calls` times each with the GPU
    held busy (a first, untimed round warms the allocator, as in `_host_ms`): the host's drift during
    the measurement falls on every fn alike."""
    import statistics

    for _round in range(2):  # the second is timed
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # ~2 s of GPU time, longer than the calls take to enqueue
        times = [[] for _ in fns]
        for _ in range(calls):
            for fn, t in zip(fns, times, strict=True):
                start = time.perf_counter()
                fn()
                t.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return [statistics.median(t) * 1e6 for t in times]


def _launch_ways(run, jit, args, grid, kwargs, kernel):
    """One recorded Triton launch as three callables: through `JITFunction.run`, its argument binder
    alone, and the compiled kernel's launcher called directly with the bound arguments."""
    binder = jit.device_caches[torch.cuda.current_device()][4]
    bound = list(binder(*args, **kwargs)[0].values())
    g = tuple(grid) + (1,) * (3 - len(grid))
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        kernel.run(*g, stream, kernel.function, kernel.packed_metadata, None, None, None, *bound)

    return (lambda: run(jit, *args, grid=grid, warmup=False, **kwargs), lambda: binder(*args, **kwargs),
            direct)


def launches():
    import triton
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = _inputs(1, 8192, 16, 4, D, grad=False)
    recorded = []
    run = JITFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        recorded.append((self, args, grid, kwargs, kernel))
        return kernel

    with torch.no_grad():
        fn = lambda: nsa_prefill(**x)  # noqa: E731
        fn()
        JITFunction.run = recording
        try:  # every launch through JITFunction.run, to record it
            _with_flags(_triton_utils, dict(DIRECT_LAUNCH=False), fn)
        finally:
            JITFunction.run = run
        torch.cuda.synchronize()
        ways = [functools.partial(_with_flags, _triton_utils, dict(DIRECT_LAUNCH=d), fn)
                for d in (False, True)]
        for r in range(3):
            us = _host_interleaved_us(ways, 100)
            print(f"T=8192 16/4 heads round {r}: the NSA forward's host time with DIRECT_LAUNCH = False / "
                  f"True, median of 100 calls each, interleaved: {us[0]:.1f} / {us[1]:.1f} us", flush=True)
        whole = _host_ms(lambda: _with_flags(_triton_utils, dict(DIRECT_LAUNCH=False), fn), 50) * 1e3
        print(f"T=8192 16/4 heads: the NSA forward through JITFunction.run, host {whole:.1f} us a call, "
              f"{len(recorded)} Triton launches", flush=True)
        totals = [0.0, 0.0, 0.0]
        for jit, args, grid, kwargs, kernel in recorded:
            us = [_host_ms(w, 50) * 1e3 for w in _launch_ways(run, jit, args, grid, kwargs, kernel)]
            totals = [a + b for a, b in zip(totals, us, strict=True)]
            n_desc = sum(isinstance(a, TensorDescriptor) for a in args)
            print(f"  {jit.fn.__name__} ({len(args)} args, {n_desc} descriptors): JITFunction.run "
                  f"{us[0]:.1f} us, binder {us[1]:.1f}, direct launch {us[2]:.1f}", flush=True)
        print(f"  all launches: JITFunction.run {totals[0]:.1f} us, binder {totals[1]:.1f}, direct "
              f"{totals[2]:.1f}; the rest of the forward {whole - totals[0]:.1f} us", flush=True)
        k = x["k"]
        costs = {
            "TensorDescriptor [1, 64, 1, 128]": lambda: TensorDescriptor(k, list(k.shape), list(k.stride()),
                                                                         [1, 64, 1, 128]),
            "torch.empty": lambda: torch.empty(1024, device="cuda"),
            "triton.cdiv": lambda: triton.cdiv(8192, 64),
            "-(-a // b)": lambda: -(-8192 // 64),
        }
        for name, fn in costs.items():
            print(f"  {name}: {_host_ms(fn, 200) * 1e3:.2f} us a call", flush=True)


def graph():
    for hq in (16, 64):
        x = _inputs(1, 8192, hq, 4, D, grad=False)
        with torch.no_grad():
            fn = functools.partial(nsa_prefill, **x)
            fn()
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()["segment.all.allocated"]
            host = _host_ms(fn, 50) * 1e3
            segments = torch.cuda.memory_stats()["segment.all.allocated"] - before
            print(f"T=8192 {hq}/4 heads: host {host:.0f} us a forward, {segments} new segments over 51 "
                  f"forwards with the GPU busy", flush=True)
            replay = cuda_graph_replay(fn)
            for r in range(3):
                eager, graphed = _time(fn), _time(replay)
                print(f"T=8192 {hq}/4 heads round {r}: forward eager {eager:.3f} ms, CUDA graph "
                      f"{graphed:.3f} ms, host replay {_host_ms(replay, 50) * 1e3:.0f} us", flush=True)
        del replay
        torch.cuda.empty_cache()


MODES = {"compare": compare, "launch": launch, "profile": profile, "accuracy": accuracy, "index": index,
         "host": host, "sync": sync, "gate": gate, "gate-backward": gate_backward,
         "host-stages": host_stages, "bench-order": bench_order, "launches": launches,
         "graph": graph}

if __name__ == "__main__":
    for mode in sys.argv[1:] or ["compare"]:
        MODES[mode]()

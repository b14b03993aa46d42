"""The selected forward per key block (`selected_by_block`) against the position-major walk, side by
side on one GPU (run 115 on the H200).

    PYTHONPATH=. python3 scripts/probe_by_block.py [compare] [launch] [profile] [accuracy] [index] [host]
        [sync]

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
"""

import sys
import time

import torch

from nsa_eval.bench import _inputs, _time, _with_flags, nsa_prefill, profile_kernels
from nsa_eval.kernels import selected_by_block, selection
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.importance import select_blocks

D = 128
WALK = dict(SELECTED_BY_BLOCK_MAX_GROUP=0)
BY_BLOCK = dict(SELECTED_BY_BLOCK_MAX_GROUP=16, SELECTED_BY_BLOCK_MIN_ROWS=0)


def _block_lists(x):
    """The block lists `select_blocks` gives for the inputs x (their compression lse first)."""
    with torch.no_grad():
        _, lse_cmp = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        return select_blocks(x["q"], x["k_cmp"], lse=lse_cmp)


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
        idx = _block_lists(x)
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
            idx = _block_lists(x)
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
        idx = _block_lists(x)
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
    launch waits for the GPU."""
    fn()
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
        idx = _block_lists(x)
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
    idx = _block_lists(x)

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


MODES = {"compare": compare, "launch": launch, "profile": profile, "accuracy": accuracy, "index": index,
         "host": host, "sync": sync}

if __name__ == "__main__":
    for mode in sys.argv[1:] or ["compare"]:
        MODES[mode]()

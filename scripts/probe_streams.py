"""Which kernels run beside which (run 75 on the H200): the NSA forward and forward+backward with
their compute-bound banded kernels queued on side streams next to the selected branch, which waits on
L2 reads and float32 atomics, timed side by side on one GPU.

    PYTHONPATH=. python3 scripts/probe_streams.py [layouts] [profile]   (default: both)

layouts: per shape (64k at 64/4 and 16/4 heads, 8k at 64/4), the forward (no grad) and the
forward+backward under each stream layout of `kernels.prefill`: one stream (`WINDOW_STREAM` off), the
window's forward after the compression forward (the default) or after the block selection
(`WINDOW_FORWARD_AFTER`), the compression backward on a stream of its own
(`COMPRESSION_BACKWARD_STREAM`), each with the side streams at normal and at high priority
(`SIDE_STREAM_PRIORITY`), and the compression stream with the selected dk/dv at 4 warps and 32 rows
(a program that leaves registers for a banded one on the same SM). Each layout's output against
the default's (bit for bit: the same kernels) and its gradients (the selected dq's atomics add in
any order). profile: the kernels' device times of the 8k forward and G = 4's at 64k (torch.profiler).
"""

import sys

import torch

from nsa_eval.bench import _fwd_bwd, _inputs, _time, _with_flags, nsa_prefill
from nsa_eval.kernels import prefill, selection

D = 128
HIGH = -1  # the highest CUDA stream priority torch maps it to
LAYOUTS = {
    "one stream": dict(WINDOW_STREAM=False),
    "default (window after the compression forward)": dict(),
    "window after the compression forward, high priority": dict(SIDE_STREAM_PRIORITY=HIGH),
    "window after the selection": dict(WINDOW_FORWARD_AFTER="selection"),
    "window after the selection, high priority": dict(WINDOW_FORWARD_AFTER="selection",
                                                      SIDE_STREAM_PRIORITY=HIGH),
    "compression backward stream": dict(COMPRESSION_BACKWARD_STREAM=True),
    "compression backward stream, high priority": dict(COMPRESSION_BACKWARD_STREAM=True,
                                                       SIDE_STREAM_PRIORITY=HIGH),
    "both, high priority": dict(WINDOW_FORWARD_AFTER="selection", COMPRESSION_BACKWARD_STREAM=True,
                                SIDE_STREAM_PRIORITY=HIGH),
}
SMALL_DKV = dict(SELECTED_DKV_ROWS=32, SELECTED_DKV_CONFIG=dict(num_warps=4, num_stages=3))


def run_with(layout, fn, sel_knobs=None):
    return _with_flags(prefill, layout, lambda: _with_flags(selection, sel_knobs or {}, fn))


def forward_and_grads(x, do):
    leaves = [t for t in x.values() if t.requires_grad]
    o = nsa_prefill(**x)
    return o, torch.autograd.grad(o, leaves, do)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def probe_layouts(T, hq, hkv):
    x = _inputs(1, T, hq, hkv, D, grad=True)
    do = torch.randn(1, T, hq, D, device="cuda", dtype=torch.bfloat16)
    print(f"T={T}, {hq}/{hkv} heads:", flush=True)
    want_o, want_g = forward_and_grads(x, do)
    variants = [(name, layout, None) for name, layout in LAYOUTS.items()]
    variants.append(("compression backward stream, high priority, selected dk/dv 4 warps x 32 rows",
                     dict(COMPRESSION_BACKWARD_STREAM=True, SIDE_STREAM_PRIORITY=HIGH), SMALL_DKV))
    variants.append(("selected dk/dv 4 warps x 32 rows alone", dict(), SMALL_DKV))
    for name, layout, sel in variants:
        try:
            o, g = run_with(layout, lambda: forward_and_grads(x, do), sel)
            same = torch.equal(o, want_o)
            worst = max(rel(a, b) for a, b in zip(g, want_g, strict=True))
            with torch.no_grad():
                fwd = run_with(layout, lambda: _time(lambda: nsa_prefill(**x)), sel)
            fb = run_with(layout, lambda: _time(_fwd_bwd(lambda: nsa_prefill(**x), x)), sel)
            print(f"  {name}: fwd {fwd:.3f} ms, fwd+bwd {fb:.2f} ms (output equal: {same}, "
                  f"worst gradient rel. diff {worst:.1e})", flush=True)
        except Exception as e:  # a layout that fails is a result too
            print(f"  {name}: failed, {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def kernel_table(label, fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0:
            rows.append((total / 5 / 1000, e.count // 5, e.key))
    print(f"{label}: kernels per call (ms, launches), {sum(r[0] for r in rows):.3f} ms in all", flush=True)
    for ms, n, key in sorted(rows, reverse=True)[:14]:
        print(f"  {ms:8.3f}  x{n}  {key[:110]}", flush=True)


def probe_profile(T, hq, hkv):
    x = _inputs(1, T, hq, hkv, D, grad=False)
    with torch.no_grad():
        wall = _time(lambda: nsa_prefill(**x))
        kernel_table(f"T={T}, {hq}/{hkv} heads, forward ({wall:.3f} ms a call)", lambda: nsa_prefill(**x))


def main():
    parts = sys.argv[1:] or ["layouts", "profile"]
    print(torch.cuda.get_device_name(), flush=True)
    if "layouts" in parts:
        for T, hq, hkv in ((65536, 64, 4), (65536, 16, 4), (8192, 64, 4)):
            probe_layouts(T, hq, hkv)
            torch.cuda.empty_cache()
    if "profile" in parts:
        for T, hq, hkv in ((8192, 64, 4), (65536, 16, 4)):
            probe_profile(T, hq, hkv)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

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
  KV expansion), both replayed from CUDA graphs.

The NSA prefill composes the Triton ops like `nsa_eval.kernels.nsa_attention(impl="triton")`, with
the compression lse reused by the block selection.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
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
    extra: dict = field(default_factory=dict)


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


def block_lists(x):
    """The block lists `select_blocks` makes for `_inputs`' x, from their compression lse:
    int32 [B, T, Hkv, num_selected]."""
    import torch

    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.importance import select_blocks

    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        return select_blocks(x["q"], x["k_cmp"], lse=lse)


MIN_TIMED_CALLS = 5


def timing_window(rep_ms: float, estimate_ms: float, min_calls: int = MIN_TIMED_CALLS) -> float:
    """The `rep` (ms) to give `do_bench` so that it times at least `min_calls` calls of an
    `estimate_ms` function: it times rep / estimate calls, a single one past `rep` (before run 92, the
    64k forward+backward's median was one sample, and four such measurements spread 109.5-113.1 ms).
    The 1.25 covers do_bench's own estimate, which clears L2 before each call."""
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


def bench_decode(T, batch, hq, hkv, d, variants=True):
    """NSA decode (CUDA graph) vs SDPA decode over the full cache (flash and cuDNN, CUDA graph), the
    decode's memory floor and, with `variants`, the other decode settings."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa_eval.kernels.decode import nsa_decode

    dev, bf = "cuda", torch.bfloat16
    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    q = torch.randn(batch, 1, hq, d, device=dev, dtype=bf)
    k = torch.randn(batch, T, hkv, d, device=dev, dtype=bf)
    v = torch.randn(batch, T, hkv, d, device=dev, dtype=bf)
    k_cmp = torch.randn(batch, tc, hkv, d, device=dev, dtype=bf)
    v_cmp = torch.randn(batch, tc, hkv, d, device=dev, dtype=bf)
    gates = [torch.rand(batch, 1, hq, device=dev, dtype=bf) for _ in range(3)]
    seqlens = torch.full((batch,), T, device=dev, dtype=torch.int32)
    nsa = lambda: nsa_decode(q, k, v, k_cmp, v_cmp, *gates, cache_seqlens=seqlens)  # noqa: E731
    out = {"nsa": _time_graph(nsa), "nsa_nograph": _time(nsa)}
    from nsa_eval.kernels import decode, topk

    # the same caches stored head-major ([B, Hkv, T, d] memory, same logical shape): a selected block
    # of one head is then one contiguous 16 KB run instead of 64 rows 1 KB apart
    hm = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v, k_cmp, v_cmp)]
    beside = {  # measurements beside the table's, each allowed to fail alone
        "nsa_v1": lambda: _with_flag(decode, "DECODE_VARIANT", "v1", lambda: _time_graph(nsa)),
        "nsa_merge": lambda: _with_flag(decode, "MERGE_IN_ATTN", not decode.MERGE_IN_ATTN,
                                        lambda: _time_graph(nsa)),
        "nsa_headmajor": lambda: _time_graph(lambda: nsa_decode(q, *hm, *gates, cache_seqlens=seqlens)),
        **{f"nsa_topk[{label}]": lambda flags=flags: _with_flags(topk, flags,
                                                                  lambda: _time_graph(nsa))
           for label, flags in _decode_topk_variants().items()},
        "nsa_scores": lambda: _with_flag(decode, "DECODE_IMPORTANCE", "scores", lambda: _time_graph(nsa)),
        "nsa_tf32": lambda: _with_flag(decode, "TILE_MAP", "tf32x3", lambda: _time_graph(nsa)),
        "nsa_unrolled": lambda: _with_flag(decode, "SEL_STAGES", 0, lambda: _time_graph(nsa)),
        "floor": lambda: decode_floor(T, batch, hq, hkv, d, k, v),
    }
    if not variants:
        beside = {"floor": beside["floor"]}
    for name, measure in beside.items():
        try:
            value = measure()
        except Exception as err:
            print(f"decode {name} failed at T={T}: {str(err).splitlines()[0][:160]}")
            continue
        if isinstance(value, dict):
            out.update(value)
        else:
            out[name] = value
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


def _other_topk():
    """The top-k method the decode profiles beside the default: bitonic, or arg-max if that is it."""
    from nsa_eval.kernels import topk

    return "argmax" if topk.TOPK_METHOD == "bitonic" else "bitonic"


def _decode_topk_variants() -> dict[str, dict]:
    """The top-k settings the decode is timed with beside the defaults: label -> `topk` flags
    (those that differ from the defaults)."""
    from nsa_eval.kernels import topk
    from nsa_eval.kernels.decode import step2_method

    variants = {"bitonic top-k": dict(TOPK_METHOD="bitonic"), "arg-max top-k": dict(TOPK_METHOD="argmax")}
    method = step2_method()  # the pick matters only to the filter
    for pick in topk.TOPK_FILTER_PICKS:
        if method == "filter" or pick == topk.TOPK_FILTER_PICK:
            variants[f"filter top-k, {pick} picks"] = dict(TOPK_METHOD="filter", TOPK_FILTER_PICK=pick)
    default = {"TOPK_METHOD": method, "TOPK_FILTER_PICK": topk.TOPK_FILTER_PICK}
    same = lambda flags: all(default[k] == v for k, v in flags.items())  # noqa: E731
    return {label: flags for label, flags in variants.items() if not same(flags)}


def _with_flags(module, flags: dict, fn):
    """fn() with each module.name in flags set to its value, restored afterwards."""
    if not flags:
        return fn()
    (name, value), *rest = flags.items()
    return _with_flag(module, name, value, lambda: _with_flags(module, dict(rest), fn))


def _with_flag(module, name, value, fn):
    """fn() with module.name set to value, restored afterwards."""
    default = getattr(module, name)
    setattr(module, name, value)
    try:
        return fn()
    finally:
        setattr(module, name, default)


def decode_floor(T, batch, hq, hkv, d, k, v):
    """The decode's memory floor: the bytes NSA decode must read (all visible compressed keys and
    values, n selected blocks and the window, per sequence and KV head) at the bandwidth measured by
    reading the full caches `k` and `v` once (`floors.stream_sum`, the bytes SDPA decode reads).
    Returns hbm_tb_s, nsa_bytes, floor_ms."""
    from nsa_eval.kernels.floors import stream_sum

    full_bytes = (k.numel() + v.numel()) * k.element_size()
    t_stream = _time_graph(lambda: (stream_sum(k), stream_sum(v)))
    p = PAPER
    tc = (T - p["block_len"]) // p["stride"] + 1
    tokens = tc + min(p["num_selected"] * p["select_size"], T) + min(p["window"], T)
    nsa_bytes = batch * hkv * tokens * 2 * d * k.element_size()
    bandwidth = full_bytes / (t_stream * 1e-3)  # bytes / s
    return {"hbm_tb_s": bandwidth / 1e12, "nsa_bytes": nsa_bytes, "floor_ms": nsa_bytes / bandwidth * 1e3}


def bench_selected_floor(T, hq, hkv, d=128):
    """The selected-attention forward beside its reads alone (`floors.gather_blocks_sum`: the same
    blocks, no math), on the block lists `select_blocks` makes from random inputs. Returns
    (fwd ms, reads ms, GB read)."""
    import torch

    from nsa_eval.kernels.floors import gather_blocks_sum
    from nsa_eval.kernels.selection import selected_attention

    x = _inputs(1, T, hq, hkv, d, grad=False)
    idx = block_lists(x)
    with torch.no_grad():
        t_fwd = _time(lambda: selected_attention(x["q"], x["k"], x["v"], idx))
        t_reads = _time(lambda: gather_blocks_sum(x["k"], x["v"], idx))
    t = torch.arange(T, device=idx.device)[None, :, None, None]
    blocks = ((idx >= 0) & (idx <= t // PAPER["select_size"])).sum().item()
    gb = blocks * PAPER["select_size"] * 2 * d * x["k"].element_size() / 1e9
    return t_fwd, t_reads, gb


def bench_ops(T, hq, hkv, d=128):
    """Forward and forward+backward time of each Triton op alone (where the time goes)."""
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
            out[name] = [_time(fn)]
    for name, fn in ops.items():
        out[name].append(_time(_fwd_bwd(fn, x)))
    out.update(bench_variants(x, lse, idx))
    return out


def bench_variants(x, lse, idx):
    """Alternatives to the default kernels, timed beside them (ms): the other top-k methods (and the
    top-k alone at several launch shapes), the importance kernel with every chunk masked and with the
    plain map, launch configurations of the selected-attention forward and of each part of the banded
    kernels (dq/dkv: forward+backward), the banded kernels' single masked loop (BAND_SPLIT_MASK=False)
    and the window's split backward, each op with per-thread loads instead of TMA copies; the whole NSA
    as one autograd op and composed from the branches' ops, with the window on the main stream, with
    the banded tiles in index order, and without TMA."""
    import torch

    from nsa_eval.kernels import band, importance, selection, topk

    out = {}

    def timed(name, module, attr, value, fn):
        try:
            out[name] = (_with_flag(module, attr, value, lambda: _time(fn)), None)
        except Exception as err:  # a configuration may not compile; keep going
            print(f"variant {name} failed: {str(err).splitlines()[0][:160]}")

    with torch.no_grad():
        sel = lambda: importance.select_blocks(x["q"], x["k_cmp"], lse=lse)  # noqa: E731
        for method in (m for m in topk.TOPK_METHODS if m != topk.TOPK_METHOD):
            timed(f"select_blocks [{method} top-k]", topk, "TOPK_METHOD", method, sel)
        # the top-k alone, every method, on the importances of this input
        T, hkv = x["q"].shape[1], x["k_cmp"].shape[2]
        imp = importance.block_importance(x["q"], x["k_cmp"], lse, block_len=PAPER["block_len"],
                                         stride=PAPER["stride"], select_size=PAPER["select_size"],
                                         scale=x["q"].shape[-1] ** -0.5)
        run_topk = lambda: topk.topk_blocks(  # noqa: E731
            imp, T=T, num_kv_heads=hkv, select_size=PAPER["select_size"], num_selected=PAPER["num_selected"],
            num_init=1, num_local=2)
        other_pick = next(p for p in topk.TOPK_FILTER_PICKS if p != topk.TOPK_FILTER_PICK)
        timed(f"topk_blocks [filter, {other_pick} picks]", topk, "TOPK_FILTER_PICK", other_pick,
              lambda: _with_flag(topk, "TOPK_METHOD", "filter", run_topk))
        for method in topk.TOPK_METHODS:
            timed(f"topk_blocks [{method}]", topk, "TOPK_METHOD", method, run_topk)
            for rows, warps in ((1, 1), (2, 1), (4, 1), (2, 2)):  # fewer warps per row
                label = f"topk_blocks [{method}, {rows} rows, {warps} warps]"
                timed(label, topk, "TOPK_CONFIG", dict(rows=rows, num_warps=warps),
                      lambda: _with_flag(topk, "TOPK_METHOD", method, run_topk))  # noqa: B023
        timed("select_blocks [importance, all masked]", importance, "IMPORTANCE_SPLIT_MASK", False, sel)
        timed("select_blocks [importance, plain map]", importance, "IMPORTANCE_LANE_MAP", False, sel)
        fwd = lambda: selection.selected_attention(x["q"], x["k"], x["v"], idx)  # noqa: E731
        for warps, stages in ((2, 2), (1, 3)):
            timed(f"selected_attention [warps={warps} stages={stages}]", selection, "SELECTED_FWD_CONFIG",
                  dict(num_warps=warps, num_stages=stages), fwd)
        timed("select_blocks [importance broadcast]", importance, "IMPORTANCE_MAP", "broadcast", sel)
        for rows, warps in ((128, 8), (128, 4), (256, 16)):
            reshape = dict(rows=rows, num_warps=warps, num_stages=3)
            config = dict(importance.IMPORTANCE_CONFIG, reshape=reshape)
            timed(f"select_blocks [importance {rows} rows, {warps} warps]", importance, "IMPORTANCE_CONFIG",
                  config, sel)
    fwd_bwd = _fwd_bwd(fwd, x)
    timed("selected_attention [dq walk]", selection, "SELECTED_DQ", "walk", fwd_bwd)
    timed("selected_attention [dkv 64 rows, 3 stages]", selection, "SELECTED_DKV_WIDE", None, fwd_bwd)
    # banded kernels: one part's configuration changed at a time
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.window import sliding_window_attention

    branches = {
        "cmp": ("compressed_attention", lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0]),
        "swa": ("sliding_window_attention", lambda: sliding_window_attention(x["q"], x["k"], x["v"])),
    }
    alternatives = {  # (BM, BN, num_warps, num_stages) per branch and part
        "cmp": {"fwd": [(128, 64, 8, 3), (128, 64, 8, 2)],
                "dq": [(128, 64, 8, 2), (64, 128, 8, 2)],
                "dkv": [(32, 128, 8, 2), (64, 128, 8, 2)]},
        "swa": {"fwd": [(128, 64, 8, 2), (128, 128, 8, 2)],
                "dq": [(128, 64, 8, 2)],
                "dkv": [(64, 128, 8, 2)]},
    }
    for branch, (op, fn) in branches.items():
        for part, configs in alternatives[branch].items():
            # the forward's own tiles where it copies them with TMA (`BAND_CONFIGS[..]["fwd_tma"]`)
            window = None if branch == "cmp" else 512
            key = "fwd_tma" if part == "fwd" and band._tma(window, "fwd") else part
            key = key if key in band.BAND_CONFIGS[branch] else part
            for bm, bn, warps, stages in configs:
                cfg = dict(BM=bm, BN=bn, num_warps=warps, num_stages=stages)
                table = {b: dict(parts) for b, parts in band.BAND_CONFIGS.items()}
                table[branch][key] = cfg
                name = f"{op} [{part} " + " ".join(f"{k}={v}" for k, v in cfg.items()) + "]"
                if part == "fwd":
                    with torch.no_grad():
                        timed(name, band, "BAND_CONFIGS", table, fn)
                else:
                    timed(name, band, "BAND_CONFIGS", table, _fwd_bwd(fn, x))
    # the banded kernels' single masked loop against the default split (masked edge tiles, unmasked
    # interior); "[dq " files a row under forward+backward
    cmp, swa = branches["cmp"][1], branches["swa"][1]
    with torch.no_grad():
        timed("compressed_attention [masked loop]", band, "BAND_SPLIT_MASK", False, cmp)
        timed("sliding_window_attention [masked loop]", band, "BAND_SPLIT_MASK", False, swa)
    timed("compressed_attention [dq dkv masked loop]", band, "BAND_SPLIT_MASK", False,
          _fwd_bwd(cmp, x))
    # per-thread loads instead of TMA copies (BAND_TMA, SELECTED_TMA)
    with torch.no_grad():
        timed("compressed_attention [loads]", band, "BAND_TMA", False, cmp)
        timed("sliding_window_attention [loads]", band, "BAND_TMA", False, swa)
        timed("selected_attention [loads]", selection, "SELECTED_TMA", False, fwd)
    timed("compressed_attention [dq dkv loads]", band, "BAND_TMA", False, _fwd_bwd(cmp, x))
    timed("sliding_window_attention [dq dkv loads]", band, "BAND_TMA", False, _fwd_bwd(swa, x))
    # the window's backward the other way from its default (split with Triton 3.8, masked before)
    other = {**band.BAND_SPLIT_MASK, "swa": ("fwd",) if band.TRITON_38 else ("fwd", "dq", "dkv")}
    timed(f"sliding_window_attention [dq dkv {'masked' if band.TRITON_38 else 'split'}]", band,
          "BAND_SPLIT_MASK", other, _fwd_bwd(swa, x))
    # the whole NSA as one autograd op (deltas from the gate backward, one dq sum) and composed from
    # the branches' ops, side by side
    from nsa_eval.kernels import prefill

    whole = _fwd_bwd(lambda: nsa_prefill(**x), x)
    forward = lambda: nsa_prefill(**x)  # noqa: E731
    for fused, label in ((True, "fused"), (False, "composed")):
        timed(f"nsa_attention [{label} backward]", prefill, "FUSED_BACKWARD", fused, whole)
    # the window branch in line with the others (its default: a second stream) and the banded kernels'
    # tiles in index order (default: the longest first), beside the defaults; "[dq " files the
    # forward+backward rows under forward+backward
    with torch.no_grad():
        timed("nsa_attention [defaults]", prefill, "FUSED_BACKWARD", True, forward)  # the forward again
        timed("nsa_attention [window on one stream]", prefill, "WINDOW_STREAM", False, forward)
        timed("nsa_attention [band tiles in index order]", band, "BAND_LONGEST_FIRST", False,
              forward)
        gate_other = "apart" if prefill.GATE_IN_SELECTED else "in selected"  # the other choice
        timed(f"nsa_attention [gated sum {gate_other}]", prefill, "GATE_IN_SELECTED",
              not prefill.GATE_IN_SELECTED, forward)
    timed("nsa_attention [dq window on one stream]", prefill, "WINDOW_STREAM", False, whole)
    timed("nsa_attention [dq gates in the branches]", prefill, "GATE_IN_BRANCHES", True, whole)
    timed(f"nsa_attention [dq gated sum {gate_other}]", prefill, "GATE_IN_SELECTED",
          not prefill.GATE_IN_SELECTED, whole)
    for dq_sum in (m for m in prefill.DQ_SUMS if m != prefill.DQ_SUM):  # the branches' dq summed otherwise
        timed(f"nsa_attention [dq sum {dq_sum}]", prefill, "DQ_SUM", dq_sum, whole)
    timed("nsa_attention [dq band tiles in index order]", band, "BAND_LONGEST_FIRST", False, whole)
    no_tma = lambda fn: lambda: _with_flag(band, "BAND_TMA", False, fn)  # noqa: E731
    with torch.no_grad():
        timed("nsa_attention [no TMA]", selection, "SELECTED_TMA", False, no_tma(forward))
    timed("nsa_attention [dq no TMA]", selection, "SELECTED_TMA", False, no_tma(whole))
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


def _profile_decode(T, hq, hkv, d, batch, log=print):
    import torch

    from nsa_eval.kernels.decode import nsa_decode

    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = r(batch, 1, hq, d), r(batch, T, hkv, d), r(batch, T, hkv, d)
    kc, vc = r(batch, tc, hkv, d), r(batch, tc, hkv, d)
    gates = [torch.rand(batch, 1, hq, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    from nsa_eval.kernels import decode

    def profile(label):
        log(f"kernels of NSA decode, B={batch}, T={T} (plain launches, {label}):")
        try:
            profile_kernels(lambda: nsa_decode(q, k, v, kc, vc, *gates), log, iters=20, top=5)
        except Exception as err:  # the profiler is optional
            log(f"profiling failed: {str(err).splitlines()[0][:160]}")

    profile("defaults")
    for flag in ("MERGE_IN_ATTN", "TOPK_IN_STEP2"):  # each launch-structure flag flipped
        value = not getattr(decode, flag)
        _with_flag(decode, flag, value, lambda: profile(f"{flag}={value}"))  # noqa: B023
    from nsa_eval.kernels import topk

    other = _other_topk()  # the other top-k, in step 2's last program and in a launch of its own

    def profile_other(in_step2):
        label = f"TOPK_METHOD={other}, TOPK_IN_STEP2={in_step2}"
        _with_flag(decode, "TOPK_IN_STEP2", in_step2, lambda: profile(label))

    for in_step2 in (True, False):
        _with_flag(topk, "TOPK_METHOD", other, lambda: profile_other(in_step2))  # noqa: B023


def run_kernel_benchmark(lengths=(8192, 16384, 32768, 65536), *, heads=64, kv_heads=4, dim=128,
                         decode_batch=16, g4_heads=(16, 4), fla=True, variants=True, log=print) -> list[Row]:
    """Measure everything; returns one Row per (case, impl, T). `variants=False`: the report's tables
    only (NSA, SDPA, fla, G=4, decode and its floor), without the other settings, the per-kernel
    profiles, the ops alone and the selected branch's floor."""
    import torch

    rows: list[Row] = []
    hs = f"{heads}/{kv_heads}"
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

    for T in lengths:
        t_fwd, t_fb = bench_nsa_prefill(T, heads, kv_heads, dim)
        add("fwd", "nsa-triton", T, hs, 1, t_fwd)
        add("fwd+bwd", "nsa-triton", T, hs, 1, t_fb)
        for backend in ("cudnn", "flash"):
            try:
                f, fb = bench_sdpa_prefill(T, heads, kv_heads, dim, backend)
            except Exception as err:
                f = fb = None
                log(f"sdpa {backend} failed at T={T}: {str(err).splitlines()[0][:160]}")
            add("fwd", f"sdpa-{backend}", T, hs, 1, f)
            add("fwd+bwd", f"sdpa-{backend}", T, hs, 1, fb)
        if has_fla:
            try:
                f, fb = bench_fla_prefill(T, heads, kv_heads, dim)
            except Exception as err:
                f = fb = None
                log(f"fla failed at T={T}: {str(err).splitlines()[0][:160]}")
            add("fwd", "fla-parallel_nsa", T, hs, 1, f, "no window branch, mean-pool l=d=64")
            add("fwd+bwd", "fla-parallel_nsa", T, hs, 1, fb, "no window branch, mean-pool l=d=64")
        g4 = f"{g4_heads[0]}/{g4_heads[1]}"
        f, fb = bench_nsa_prefill(T, g4_heads[0], g4_heads[1], dim)
        add("fwd", "nsa-triton", T, g4, 1, f)
        add("fwd+bwd", "nsa-triton", T, g4, 1, fb)
        for (hq, hkv), heads_str in (((heads, kv_heads), hs), (g4_heads, g4)):
            add("fwd", "nsa-triton-graph", T, heads_str, 1, bench_nsa_prefill_graph(T, hq, hkv, dim),
                "replayed from a CUDA graph")
            torch.cuda.empty_cache()  # the graph's private memory
        dec = bench_decode(T, decode_batch, heads, kv_heads, dim, variants=variants)
        add("decode", "nsa-triton", T, hs, decode_batch, dec["nsa"], "CUDA graph")
        add("decode", "nsa-triton-nograph", T, hs, decode_batch, dec["nsa_nograph"], "plain launches")
        if "floor_ms" in dec:
            add("floor", "decode: NSA bytes at HBM bandwidth", T, hs, decode_batch, dec["floor_ms"],
                f"{dec['nsa_bytes'] / 1e6:.0f} MB at {dec['hbm_tb_s']:.2f} TB/s (read of the full caches)")
        if variants:
            _add_decode_variants(add, dec, T, hs, decode_batch)
            try:
                f, reads, gb = bench_selected_floor(T, heads, kv_heads, dim)
                add("floor", "selected_attention fwd", T, hs, 1, f)
                add("floor", "selected_attention fwd: its reads alone", T, hs, 1, reads,
                    f"{gb:.1f} GB: {gb / reads:.2f} TB/s")
            except Exception as err:  # a measurement beside the table's: keep going
                log(f"selected floor failed: {str(err).splitlines()[0][:160]}")
            _profile_decode(T, heads, kv_heads, dim, decode_batch, log)
        for name in ("flash", "cudnn"):
            note = dec.get(name + "_error", "CUDA graph")
            add("decode", f"sdpa-{name}", T, hs, decode_batch, dec[name], note)
        torch.cuda.empty_cache()
    if not variants:
        return rows
    T = max(lengths)
    try:
        profile_prefill(T, heads, kv_heads, dim, log, g4_heads=g4_heads)
    except Exception as err:  # the profiler is optional
        log(f"profiling failed: {str(err).splitlines()[0][:160]}")
    torch.cuda.empty_cache()
    for name, (f, fb) in bench_ops(T, heads, kv_heads, dim).items():
        if "[dq " in name or "[dkv " in name or name.endswith("backward]"):  # timed forward+backward
            f, fb = None, f
        if f is not None:
            add("op-fwd", name, T, hs, 1, f)
        if fb is not None:
            add("op-fwd+bwd", name, T, hs, 1, fb)
    for row in _g4_variants(T, g4_heads, dim):
        add("fwd", *row)
    return rows


def _add_decode_variants(add, dec, T, hs, batch):
    """The rows of the decode's other settings, from `bench_decode`'s measurements (None where one failed)."""
    from nsa_eval.kernels.decode import MERGE_IN_ATTN

    add("decode", "nsa-triton [v1]", T, hs, batch, dec.get("nsa_v1"), "CUDA graph, first version")
    add("decode", f"nsa-triton [MERGE_IN_ATTN={not MERGE_IN_ATTN}]", T, hs, batch, dec.get("nsa_merge"),
        "CUDA graph")
    add("decode", "nsa-triton [head-major cache]", T, hs, batch, dec.get("nsa_headmajor"),
        "CUDA graph, caches stored [B, Hkv, T, d]")
    for label in _decode_topk_variants():
        add("decode", f"nsa-triton [{label}]", T, hs, batch, dec.get(f"nsa_topk[{label}]"), "CUDA graph")
    add("decode", "nsa-triton [importance from stored scores]", T, hs, batch, dec.get("nsa_scores"),
        "CUDA graph, DECODE_IMPORTANCE='scores'")
    add("decode", "nsa-triton [tile map in tf32x3]", T, hs, batch, dec.get("nsa_tf32"),
        "CUDA graph, TILE_MAP='tf32x3'")
    add("decode", "nsa-triton [step 3 unrolled]", T, hs, batch, dec.get("nsa_unrolled"),
        "CUDA graph, SEL_STAGES=0")


def _g4_variants(T, g4_heads, dim):
    """The G=4 forward with the selected forward's other paths, to set beside the default G=4 row of
    the same run: where it runs per key block at this length (`selection.by_block`), the walk and
    float32 partials; where it walks, the walk's other launches (`SELECTED_FWD_CONFIG_MULTI`, or
    `..._TMA` where the forward copies with TMA: the other stage count, 2 <-> 3; 4 warps):
    [(impl, T, heads, batch, ms)]."""
    from nsa_eval.kernels import selected_by_block, selection

    hq, hkv = g4_heads
    run = lambda: bench_nsa_prefill(T, hq, hkv, dim)[0]  # noqa: E731
    if selection.by_block(hq // hkv, T * hkv):
        walk = _with_flag(selection, "SELECTED_BY_BLOCK_MAX_GROUP", 0, run)
        fp32 = _with_flag(selected_by_block, "BY_BLOCK_PARTIALS", "float32", run)
        return [("nsa-triton [selected walk]", T, f"{hq}/{hkv}", 1, walk),
                ("nsa-triton [by block, float32 partials]", T, f"{hq}/{hkv}", 1, fp32)]
    name = "SELECTED_FWD_CONFIG_MULTI_TMA" if selection.SELECTED_TMA else "SELECTED_FWD_CONFIG_MULTI"
    default = getattr(selection, name)
    rows = []
    others = [dict(default, num_stages=5 - default["num_stages"]), dict(default, num_warps=4)]
    for other in (o for o in others if o != default):
        ms = _with_flag(selection, name, other, run)
        label = " ".join(f"{k[4:] if k.startswith('num_') else k}={v}" for k, v in other.items()
                         if v != default[k])
        rows.append((f"nsa-triton [selected {label}]", T, f"{hq}/{hkv}", 1, ms))
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
    Triton's code generation (runs 87 and 92: the 64k forward+backward 116.5 ms with Triton 3.6,
    110.4-112.6 with 3.8 on the same H200)."""
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
    for r in rows:
        if r.case == "fwd" and r.heads == g4 and r.impl.startswith("nsa-triton ["):
            lines += ["", f"G=4 forward at T={r.T} with {r.impl[len('nsa-triton '):]}: {_fmt(r.ms)} ms "
                      f"(the default, above: {_fmt(_get(rows, 'fwd', 'nsa-triton', r.T, g4))} ms)."]
    batch = next((r.batch for r in rows if r.case == "decode"), 16)
    lines += ["", f"Decode, batch {batch}, one new token against a cache of T tokens ({hs} heads), "
              "CUDA graphs; SDPA reads the full cache (GQA, no expansion).", "",
              "| T | NSA decode | NSA (plain launches) | NSA, head-major caches | SDPA flash | SDPA cuDNN | "
              "speed-up vs flash | speed-up vs cuDNN |", "|---|---|---|---|---|---|---|---|"]
    for T in lengths:
        n, p = _get(rows, "decode", "nsa-triton", T), _get(rows, "decode", "nsa-triton-nograph", T)
        hm = _get(rows, "decode", "nsa-triton [head-major cache]", T)
        fl, cu = _get(rows, "decode", "sdpa-flash", T), _get(rows, "decode", "sdpa-cudnn", T)
        lines.append(f"| {T} | {_fmt(n, 3)} | {_fmt(p, 3)} | {_fmt(hm, 3)} | {_fmt(fl, 3)} | {_fmt(cu, 3)} | "
                     f"{_fmt(_ratio(n, fl))}x | {_fmt(_ratio(n, cu))}x |")
    for r in rows:
        if r.case == "decode" and r.impl.startswith("nsa-triton [") and "head-major" not in r.impl:
            lines += ["", f"Decode at T={r.T} with {r.impl[len('nsa-triton '):]}: {_fmt(r.ms, 3)} ms "
                      f"(the default, above: {_fmt(_get(rows, 'decode', 'nsa-triton', r.T), 3)} ms)."]
    lines += _floor_lines(rows, lengths, hs)
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


def _floor_lines(rows, lengths, hs):
    floor_rows = {(r.impl, r.T): r for r in rows if r.case == "floor"}
    if not floor_rows:
        return []
    lines = ["", "Memory floors, measured in the same run. Selected forward: the same block lists read "
             "without the math (`floors.gather_blocks_sum`). Decode: the bytes NSA must read (visible "
             "compressed keys and values, n selected blocks, the window; the paper's memory model) at the "
             "bandwidth of one read of the full caches (`floors.stream_sum`); the best speed-up = SDPA cuDNN "
             "/ that floor.", "",
             "| T | selected fwd | its reads alone | reads / fwd | decode floor | decode bytes at | "
             "NSA decode / floor | best decode speed-up vs cuDNN |", "|---|---|---|---|---|---|---|---|"]
    for T in lengths:
        f, reads, dec = (floor_rows.get((name, T)) for name in (
            "selected_attention fwd", "selected_attention fwd: its reads alone",
            "decode: NSA bytes at HBM bandwidth"))
        ms = lambda r: None if r is None else r.ms  # noqa: E731
        note = lambda r: "n/a" if r is None else r.note  # noqa: E731
        n, cu = _get(rows, "decode", "nsa-triton", T), _get(rows, "decode", "sdpa-cudnn", T)
        lines.append(f"| {T} | {_fmt(ms(f))} | {_fmt(ms(reads))} ({note(reads)}) | "
                     f"{_fmt(_ratio(ms(f), ms(reads)))} | {_fmt(ms(dec), 3)} | {note(dec)} | "
                     f"{_fmt(_ratio(ms(dec), n))} | {_fmt(_ratio(ms(dec), cu))}x |")
    return lines


def write_outputs(rows, out_dir, *, command="", **kw) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / "kernels.csv", out / "kernels.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "impl", "T", "heads", "batch", "ms", "note"])
        writer.writeheader()
        for r in rows:
            d = asdict(r)
            d.pop("extra")
            writer.writerow(d)
    md_path.write_text(markdown_report(rows, command=command, versions=software_versions(), **kw))
    return csv_path, md_path


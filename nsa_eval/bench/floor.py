"""The memory floor of a decode step: the bytes it must read, at the card's measured copy bandwidth.

A decode step reads every weight once (the output head included) and the keys and values its attention
needs; at batch B the weights are read once for all B sequences, the keys and values B times. Below

    floor_ms = (weight_bytes + B * kv_bytes) / bandwidth

no implementation of the method can go, whatever it launches. The harness prints each measured decode
step as a multiple of its floor, so methods compare as attention with attention rather than as launch
overheads.

Keys and values one step of one sequence reads, per layer and KV head, with T tokens cached (the
least each method's algorithm needs, not what one implementation happens to touch):
- full (and plain transformers): all T keys and T values;
- sink_window: the min(T, sink + local) kept keys and values;
- h2o (and h2o_dense, whose prompt attended densely): the min(T, budget) keys and values its evicting
  cache keeps (H2O's reference code drops the rest);
- quest: the min(T, budget) chosen keys and values, plus every page's key minima and maxima
  (2 ceil(T / page_size) key rows) to rank the pages;
- topk: all T keys (it scores every one) and the min(T, budget) chosen values;
- nsa: the compressed keys and values (num_compressed(T) rows), the selected blocks
  (min(T, num_selected * select_size) tokens) and the window (min(T, window) tokens).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from nsa_eval.models.cache_nsa import num_compressed

# per layer and KV head: key rows and value rows one decode step reads
ReadRows = tuple[int, int]


@dataclass(frozen=True)
class KVLayout:
    """What one cached token costs: `layers` x `kv_heads` heads of `key_dim` / `value_dim` elements of
    `itemsize` bytes."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    itemsize: int

    def bytes(self, rows: ReadRows) -> int:
        keys, values = rows
        return self.layers * self.kv_heads * (keys * self.key_dim + values * self.value_dim) * self.itemsize


@dataclass(frozen=True)
class NSAReads:
    """The NSA hyperparameters that decide what a decode step reads (NSAConfig's names)."""

    block_len: int
    stride: int
    select_size: int
    num_selected: int
    window: int


def read_rows(method: str, length: int, *, budget: int, sink: int, local: int, page_size: int = 16,
              nsa: NSAReads | None = None) -> ReadRows:
    """(key rows, value rows) per layer and KV head that one decode step of `method` reads for one
    sequence with `length` tokens cached (the module docstring gives each method's rule)."""
    T = length
    kept = min(T, budget)
    if method in ("full", "transformers"):
        return T, T
    if method == "sink_window":
        return min(T, sink + local), min(T, sink + local)
    if method in ("h2o", "h2o_dense"):
        return kept, kept
    if method == "quest":
        pages = -(-T // page_size)
        return kept + 2 * pages, kept
    if method == "topk":
        return T, kept
    if method == "nsa":
        if nsa is None:
            raise ValueError("read_rows('nsa', ...) needs the model's NSAReads")
        rows = (num_compressed(T, nsa.block_len, nsa.stride) + min(T, nsa.num_selected * nsa.select_size)
                + min(T, nsa.window))
        return rows, rows
    raise ValueError(f"read_rows: no read rule for method {method!r}")


def layout_of(model) -> KVLayout:
    """The cached token's layout of a loaded Llama or NSA model (its config and parameter dtype)."""
    c = model.config
    key_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    value_dim = getattr(c, "v_head_dim", None) or key_dim
    itemsize = next(model.parameters()).element_size()
    return KVLayout(c.num_hidden_layers, c.num_key_value_heads, key_dim, value_dim, itemsize)


def nsa_reads_of(model) -> NSAReads:
    c = model.config
    return NSAReads(c.block_len, c.stride, c.select_size, c.num_selected, c.window)


def weight_bytes(model) -> int:
    """Bytes of the model's parameters in their dtypes (tied weights counted once, as they are read)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def floor_ms(weight_bytes: int, kv_bytes: int, batch: int, bandwidth_gbs: float) -> float:
    """Milliseconds to read the weights once and `kv_bytes` for each of `batch` sequences at
    `bandwidth_gbs` (10^9 bytes per second)."""
    return (weight_bytes + batch * kv_bytes) / (bandwidth_gbs * 1e9) * 1e3


def copy_bandwidth_gbs(device: str, nbytes: int, repeats: int = 10) -> float:
    """The bandwidth of a `nbytes` copy on `device` (10^9 bytes per second), counting the bytes read and
    the bytes written, median over `repeats` copies after one warm-up: what a step that streams its
    weights and cache from memory can reach, measured rather than taken from a data sheet."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cuda = src.is_cuda
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - begin)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9

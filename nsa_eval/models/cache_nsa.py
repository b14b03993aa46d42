"""The generation cache of the NSA model: raw, window and compressed keys/values, per layer, in fixed buffers.

Per layer it keeps, each with room for `capacity` tokens (`capacity_cmp` compressed blocks):
- `k`, `v`        `[B, capacity, Hkv, Dk]` / `[.., Dv]`: the selection branch's keys (rotated) and values,
  every token (with `shared_kv` the window reads them too);
- `k_swa`, `v_swa` `[B, window, Hkv, D]`: the window branch's own keys/values (`shared_kv=False`,
  `window > 0`) for the last `window` tokens only, token `p` in row `p % window`: the branch reads no
  older one;
- `k_cmp`, `v_cmp` `[B, capacity_cmp + 1, Hkv, D]`: compressed blocks, block `i` in row `i`; the last
  row is a spare that the unfused decode step writes when its token completes no block (so that step
  has no branch);
- `k_cmp_in`, `v_cmp_in` `[B, block_len, Hkv, D]`: the compression inputs of the last `block_len`
  tokens, token `p` in row `p % block_len`, from which a decode step compresses the block its token
  completes.

So per layer and token it holds what full attention holds, `Hkv * (Dk + Dv)` values, plus the
compressed blocks' `1 / stride` of that, and a fixed `window + block_len` tokens' worth besides
(`nbytes`, `docs/models.md`).

The buffers are preallocated and written in place, so a decode step is the same launches at the same
addresses every time: the model replays it from a CUDA graph (`decode_graph.py`), one graph for the
steps whose token completes a compressed block and one for the others (`completes_block`: the others
skip the compressor). The position of the next token lives twice: `length` on the host (shapes,
statistics, which graph) and `position` `[1]` int64 on the device (what a replayed step reads and
advances). Capacity grows in steps of `CAPACITY_STEP` tokens; growing copies the buffers (and drops
the captured graphs); the rings never grow.

Every row of the batch has the same length: the NSA model does not take padded batches (the lm-eval
adapter generates row by row instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

# (k_in [B, L, Hkv, Dk], v_in [B, L, Hkv, Dv], first_block int or int64 [1] tensor)
#   -> (k_cmp [B, n, Hkv, Dk], v_cmp [B, n, Hkv, Dv])
CompressFn = Callable[[torch.Tensor, torch.Tensor, "int | torch.Tensor"], tuple[torch.Tensor, torch.Tensor]]

# Capacity is a multiple of this: the Triton decode's launch constants follow the buffer sizes
# (`NSAForCausalLM.warm_up_decode` runs every capacity once), and every token up to it is decoded by the
# same captured graph. At most this many tokens of room stand unused: 1/32 of a 32k prompt's cache.
CAPACITY_STEP = 1024

# the rings: buffer name -> the config size that gives its rows
RINGS = {"k_swa": "window", "v_swa": "window", "k_cmp_in": "block_len", "v_cmp_in": "block_len"}


def num_compressed(length: int, block_len: int, stride: int) -> int:
    """Compressed blocks over `length` tokens: 0 if length < l else (length - l) // d + 1."""
    return 0 if length < block_len else (length - block_len) // stride + 1


def round_capacity(length: int) -> int:
    """The capacity that holds `length` tokens: the next multiple of `CAPACITY_STEP`."""
    return max(1, -(-length // CAPACITY_STEP)) * CAPACITY_STEP


@dataclass(frozen=True)
class DecodeStep:
    """Where one decode token goes, as int64 device tensors (shared by every layer of a forward).

    Attributes:
        pos: `[1]` its position; lens: int32 `[B]` the tokens each row holds with it (the decode
            kernels' `cache_seqlens`); window_row: `[1]` its row in the window ring (`pos % window`).
        cmp_in_row: `[1]` its row in the ring of compression inputs; block_rows: `[block_len]` the rows
            there of the block ending at `pos`, in token order.
        first_block: `[1]` that block's index; cmp_row: `[1]` the compressed row it is written to (the
            spare row when `pos` completes no block).
    """

    pos: torch.Tensor
    lens: torch.Tensor
    window_row: torch.Tensor
    cmp_in_row: torch.Tensor
    block_rows: torch.Tensor
    first_block: torch.Tensor
    cmp_row: torch.Tensor


@dataclass
class NSALayerCache:
    """One layer's buffers (see the module docstring); None where the layer has no such tensor."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_swa: torch.Tensor | None = None
    v_swa: torch.Tensor | None = None
    k_cmp: torch.Tensor | None = None
    v_cmp: torch.Tensor | None = None
    k_cmp_in: torch.Tensor | None = None
    v_cmp_in: torch.Tensor | None = None

    def tensors(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


class NSACache:
    """Raw and compressed keys/values of every layer; what `generate()` passes back to the model.

    After a forward over T new tokens the cache holds exactly what a prefill over all tokens would
    have computed: raw keys/values of every token (the window's of the last `window`) and every
    complete compressed block. `window`: rows of the window ring, 0 where the layers have no window
    keys/values of their own.
    """

    is_compileable = False  # read by transformers' generate(): this is not transformers' StaticCache

    def __init__(self, num_layers: int, block_len: int, stride: int, window: int = 0):
        self.layers = [NSALayerCache() for _ in range(num_layers)]
        self.block_len = block_len
        self.stride = stride
        self.window = window
        self.batch = 0  # rows, set by the first forward
        self.length = 0  # tokens written (after the forward in flight, if any)
        self.capacity = 0
        self.position: torch.Tensor | None = None  # int64 [1]: the next token's position, on the device
        # the model's captured decode steps over these buffers, by whether the step completes a block
        self.decode_graphs: dict[bool, object] = {}
        self._steps: dict[tuple[int, torch.device], DecodeStep] = {}  # `step`'s, for the forward in flight

    @property
    def decode_graph(self):
        """The captured step that completes no block (15 of every 16 at the paper's stride), else the
        other one, else None."""
        return self.decode_graphs.get(False, self.decode_graphs.get(True))

    def completes_block(self, t: int = 0) -> bool:
        """Whether the forward's token `t` (position `length + t`) completes a compressed block, from the
        host's length: the block of `block_len` tokens ending there starts at a multiple of `stride`."""
        start = self.length + t + 1 - self.block_len
        return start >= 0 and start % self.stride == 0

    # ---- what transformers reads
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # unbounded: it grows

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def capacity_cmp(self) -> int:
        return num_compressed(self.capacity, self.block_len, self.stride)

    @property
    def num_cmp(self) -> int:
        """Complete compressed blocks over the tokens written."""
        return num_compressed(self.length, self.block_len, self.stride)

    def nbytes(self) -> int:
        """Bytes of every buffer the cache holds (what it keeps of the GPU's memory)."""
        return sum(getattr(layer, name).nbytes for layer in self.layers for name in layer.tensors())

    # ---- buffers
    def reserve(self, length: int) -> None:
        """Make room for `length` tokens (a new, larger set of buffers holds the old contents)."""
        if length <= self.capacity:
            return
        old_cmp = self.capacity_cmp
        self.capacity = round_capacity(length)
        self.decode_graphs = {}  # they captured the old buffers' addresses
        n_cmp = self.capacity_cmp + 1  # + the spare row
        for layer in self.layers:
            for name in ("k", "v"):
                setattr(layer, name, _grown(getattr(layer, name), self.capacity))
            for name in ("k_cmp", "v_cmp"):  # the blocks, not the old spare row
                buffer = getattr(layer, name)
                setattr(layer, name, _grown(None if buffer is None else buffer[:, :old_cmp], n_cmp))

    def _rows(self, name: str) -> int:
        if name in RINGS:
            return getattr(self, RINGS[name])
        return self.capacity_cmp + 1 if name in ("k_cmp", "v_cmp") else self.capacity

    def _allocate(self, layer: NSALayerCache, new: dict[str, torch.Tensor | None]) -> None:
        """First write to a layer: buffers of `batch` rows shaped like the new tensors `[b, T, H, D]`."""
        for name, x in new.items():
            if x is not None:
                # zeros: kernels read whole tiles, and rows past the length must stay finite
                setattr(layer, name, x.new_zeros(self.batch, self._rows(name), *x.shape[2:]))

    # ---- writes
    def prefill(self, layer_idx: int, new: dict[str, torch.Tensor | None], k_cmp: torch.Tensor,
                v_cmp: torch.Tensor, rows: slice = slice(None)) -> NSALayerCache:
        """Write a prompt's T tokens into batch rows `rows` of an empty cache (`new`: k, v, k_swa, v_swa,
        k_cmp_in, v_cmp_in as `[b, T, H, D]`, the rings' only for their last tokens) and its compressed
        blocks `[b, Tc, H, D]`."""
        layer = self.layers[layer_idx]
        T = new["k"].shape[1]
        if layer.k is None:
            self._allocate(layer, {**new, "k_cmp": k_cmp, "v_cmp": v_cmp})
        for name, x in new.items():
            if x is None:
                continue
            buffer = getattr(layer, name)
            if name in RINGS:
                last = torch.arange(max(0, T - buffer.shape[1]), T, device=x.device)  # the tokens it keeps
                buffer[rows, last % buffer.shape[1]] = x[:, last]
            else:
                buffer[rows, :T] = x
        layer.k_cmp[rows, : k_cmp.shape[1]] = k_cmp
        layer.v_cmp[rows, : v_cmp.shape[1]] = v_cmp
        return layer

    def step(self, t: int, device: torch.device, batch: int) -> DecodeStep:
        """Where the forward's token `t` goes (`position + t`) for a batch of `batch` rows, worked out
        once for all layers on `device` (device tensors: no host read). `open_forward` forgets the last
        forward's."""
        key = (t, device)
        if key not in self._steps:
            l, d = self.block_len, self.stride
            pos = self.position.to(device) + t  # [1]
            start = pos + 1 - l  # [1] the first token of the block ending here
            first = torch.div(start.clamp(min=0), d, rounding_mode="floor")  # [1] its block index
            complete = (start >= 0) & (start % d == 0)  # [1]
            self._steps[key] = DecodeStep(
                pos=pos, lens=(pos + 1).to(torch.int32).expand(batch),
                window_row=pos % max(self.window, 1), cmp_in_row=pos % l,
                block_rows=(start + torch.arange(l, device=device)) % l, first_block=first,
                cmp_row=torch.where(complete, first, self.capacity_cmp))
        return self._steps[key]

    def open_forward(self) -> None:
        """A forward (or a capture of one) begins: positions are worked out afresh from `position`."""
        self._steps = {}

    def decode(self, layer_idx: int, step: DecodeStep, new: dict[str, torch.Tensor | None],
               compress: CompressFn) -> NSALayerCache:
        """Write one token at `step.pos` (`new` as in `prefill`, T = 1) and, if it completes a
        compressed block, that block: the same device work at every position."""
        self.write_token(layer_idx, step, new)
        return self.compress_token(layer_idx, step, compress)

    def write_token(self, layer_idx: int, step: DecodeStep, new: dict[str, torch.Tensor | None]) -> None:
        """Write one token's tensors (`new` as in `prefill`, T = 1) at its rows: k, v at `step.pos`, the
        window's ring at `step.window_row`, the compression inputs' at `step.cmp_in_row`."""
        layer = self.layers[layer_idx]
        rows = {"k": step.pos, "v": step.pos, "k_swa": step.window_row, "v_swa": step.window_row,
                "k_cmp_in": step.cmp_in_row, "v_cmp_in": step.cmp_in_row}
        for name, x in new.items():
            if x is not None:
                buffer = getattr(layer, name)
                buffer.index_copy_(1, rows[name], x.to(buffer.dtype))

    def compress_token(self, layer_idx: int, step: DecodeStep, compress: CompressFn) -> NSALayerCache:
        """After the token's inputs are in the ring (`write_token`, or the fused decode's kernel): the block
        ending at `step.pos` compressed into its row, or into the spare row when it completes none."""
        layer = self.layers[layer_idx]
        k_blk, v_blk = compress(layer.k_cmp_in.index_select(1, step.block_rows),
                                layer.v_cmp_in.index_select(1, step.block_rows), step.first_block)
        layer.k_cmp.index_copy_(1, step.cmp_row, k_blk.to(layer.k_cmp.dtype))
        layer.v_cmp.index_copy_(1, step.cmp_row, v_blk.to(layer.v_cmp.dtype))
        return layer

    def begin(self, T: int, device: torch.device, batch: int) -> None:
        """Before a forward over T new tokens of `batch` rows: room for them, and the device position
        in place."""
        self.batch = self.batch or batch
        self.reserve(self.length + T)
        if self.position is None or self.position.device != device:
            self.position = torch.full((1,), self.length, dtype=torch.long, device=device)

    def advance(self, T: int) -> None:
        """The device half of finishing a forward over T tokens (inside a captured step, so a replay
        advances too); the host's `length` follows in `end`."""
        self.position.add_(T)

    def end(self, T: int) -> None:
        self.length += T

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder every tensor along the batch for beam search (in place: a captured graph stays valid)."""
        for layer in self.layers:
            for name in layer.tensors():
                tensor = getattr(layer, name)
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))


def _grown(buffer: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """`buffer` `[B, n, H, D]` copied into the first n of `rows` zeroed rows."""
    if buffer is None or buffer.shape[1] >= rows:
        return buffer
    grown = buffer.new_zeros(buffer.shape[0], rows, *buffer.shape[2:])
    grown[:, : buffer.shape[1]] = buffer
    return grown

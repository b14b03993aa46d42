"""A KV cache in fixed buffers for decoding a transformers model under an attention method.

    cache = StaticDecodeCache(capacity=prompt_len + new_tokens)
    model.generate(ids, cache=cache, ...)   # a model under apply_attention (`past_key_values=` before 5.24)

Per layer it keeps keys and values `[B, Hkv, capacity, D]` (transformers' layout) and the method's decode
state (`AttentionMethod.static_state`: H2O's mass `[B, Hq, capacity]`, Quest's page bounds). Row b's tokens
sit in slots `0 .. lens[b] - 1` with no padding: a left-padded prompt is compacted when the cache is
filled, so a key's slot is its position. `lens` `[B]` int64 lives on the device: a decode step writes its
token at `lens`, attends over the first `width` slots and adds one, all without the host, so the step is the
same launches at the same addresses at every position and can be replayed from a CUDA graph
(nsa_eval/models/hf_decode_graph.py).

The prompt runs through the model's usual path (a `DynamicCache`, the methods' prefill kernels); the
controller then copies it in (`fill`). `width` is the slots a step reads: the longest row rounded up to
`width_step`, so a step reads keys in proportion to the length, not the capacity (a graph is captured per
width). The host keeps `length` (tokens generate() has passed, padding included: what transformers reads),
`longest` and the rows' prompt lengths (the statistics).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from nsa_eval.errors import UsageError

# slots a step's width grows by: one graph capture per 1,024 tokens, and at most that many slots read idle
WIDTH_STEP = 1024


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass
class StaticCounts:
    """A static cache's decode steps that the controller's statistics do not hold yet (`fold_counts`).

    Attributes:
        rows: keys each row held after its prompt.
        heads, kv_heads: query and KV heads per layer.
        totals: `[layers, 3]` int64 on the device, summed by the steps of selecting layers: keys attended, KV
            tokens read (union over each KV head's query heads), and the most keys one query attended.
        steps: decode steps taken; folded: those already in the statistics.
        cache: the cache, while it lives (counts outlive it until folded).
    """

    rows: list[int]
    heads: int
    kv_heads: int
    totals: Tensor
    steps: int = 0
    folded: int = 0
    cache: Any = field(default=None, repr=False)  # weakref.ref to the StaticDecodeCache

    @property
    def alive(self) -> bool:
        return self.cache is not None and self.cache() is not None


class StaticDecodeCache:
    """Keys, values and method state of every layer in fixed buffers; the length per row on the device.

    Args:
        capacity: tokens per row to make room for (prompt and generation); more grows the buffers by copying
            (and drops a captured graph).
        width_step: a step attends over the first `width` slots, the longest row rounded up to this.
    """

    is_compileable = False  # read by transformers' generate(): no torch.compile of its own, no 4D masks
    is_croppable = False

    def __init__(self, capacity: int, width_step: int = WIDTH_STEP):
        for name, value in (("capacity", capacity), ("width_step", width_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"StaticDecodeCache {name} must be a positive integer, got {value!r}")
        self.capacity = capacity
        self.width_step = width_step
        self.keys: list[Tensor] = []  # per layer [B, Hkv, capacity, D]
        self.values: list[Tensor] = []  # per layer [B, Hkv, capacity, Dv]
        self.state: list[dict[str, Tensor]] = []  # per layer: the method's decode state
        self.lens: Tensor | None = None  # [B] int64 on the device: tokens each row holds
        self.step_mask: Tensor | None = None  # [B, 1, 1, 1] bool: what a step hands transformers as its mask
        self.length = 0  # tokens passed in, padding included (transformers' sequence length)
        self.longest = 0  # tokens the longest row holds
        self.width = 0  # slots the next step attends over
        self.version = 0  # counts buffer reallocations: a graph captured before one is stale
        self.controller = None  # the AttentionController that filled the cache
        self.counts: StaticCounts | None = None
        self.flash: bool | None = None  # whether dense layers run FlashAttention (None: not tried yet)
        self.decode_graph = None  # the captured decode step (nsa_eval.models.hf_decode_graph), if any
        self.graph_key: tuple[int, int] | None = None  # (version, width) it was captured at
        self.prompt_rows: list[int] = []  # `take_rows`: keys each row held after its prompt, so far

    # ---- what transformers reads
    @property
    def filled(self) -> bool:
        return self.lens is not None

    @property
    def batch_size(self) -> int:
        return 0 if self.lens is None else self.lens.shape[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # it grows

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """What transformers' mask builder asks (a decode step hands it a 4D mask: it builds none)."""
        n = query_length if isinstance(query_length, int) else query_length.shape[0]
        return self.length + n, 0

    def __len__(self) -> int:
        return len(self.keys)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write one decode token per row, key/value `[B, Hkv, 1, D]`, at slot `lens`; return the first
        `width` slots `[B, Hkv, width, D]` (the attention reads `lens` for how many are written)."""
        if not self.filled or key_states.shape[2] != 1:
            raise UsageError(
                "a StaticDecodeCache takes a prompt, then one token per row and step, through a model under "
                "nsa_eval.methods.apply_attention (which copies the prompt in); got "
                f"{key_states.shape[2]} new tokens for a {'filled' if self.filled else 'empty'} cache")
        B, H, _, D = key_states.shape
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        slot = self.lens.view(B, 1, 1, 1)
        keys.scatter_(2, slot.expand(B, H, 1, D), key_states.to(keys.dtype))
        values.scatter_(2, slot.expand(B, H, 1, values.shape[-1]), value_states.to(values.dtype))
        return keys[:, :, : self.width], values[:, :, : self.width]

    # ---- filling from the prompt's dynamic cache
    def fill(self, dynamic, mask: Tensor | None, controller, states: dict, heads: int) -> None:
        """Copy a prompt's `DynamicCache` in, layer by layer (each dynamic layer freed once copied).

        Args:
            dynamic: the transformers `DynamicCache` the prompt's forward filled, keys `[B, Hkv, T, D]`.
            mask: the prompt's 2D attention mask `[B, T]` (1 = real token) or None: real tokens are moved to
                the front of their row in order, so slot = position.
            controller: the AttentionController that ran the prompt (its method builds the decode state).
            states: the prompt's per-layer `LayerState`s (H2O's mass, keys on the last dimension).
            heads: query heads per layer (the statistics count queries per head).
        """
        if self.filled:
            raise UsageError("this StaticDecodeCache holds a sequence already: one prompt per cache")
        layers = dynamic.layers
        first = layers[0].keys
        B, T, device = first.shape[0], first.shape[2], first.device
        if mask is None or mask.dim() != 2:
            lens, order = torch.full((B,), T, dtype=torch.long, device=device), None
        else:
            real = mask[:, -T:].to(device=device, dtype=torch.bool)  # [B, T]
            lens = real.sum(-1)  # [B]
            order = torch.sort((~real).to(torch.int8), dim=-1, stable=True).indices  # [B, T] real ones first
        rows = lens.tolist()  # one read of the device, for the host's lengths
        longest = max(rows)  # slots past it hold only padding, in every row
        self.capacity = max(self.capacity, longest + 1)
        method = controller.method
        for index, layer in enumerate(layers):
            k, v = (_compact(x, order)[:, :, :longest] for x in (layer.keys, layer.values))  # [B, H, n, D]
            layer.keys = layer.values = None  # the copy replaces the dynamic layer
            self.keys.append(_padded(k, self.capacity))
            self.values.append(_padded(v, self.capacity))
            del k, v
            state = states.get(index)
            prefill = None if state is None else {
                name: _compact(t, order)[:, :, :longest] for name, t in state.tensors.items()}
            held = method.sparse and index >= controller.config.dense_layers and method.selects
            self.state.append(
                method.static_state(self.keys[-1], lens, self.capacity, prefill) if held else {})
        self.lens = lens.to(torch.long)
        self.step_mask = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=device)
        self.length, self.longest = T, longest
        self.controller = controller
        self.counts = StaticCounts(rows, heads, self.keys[0].shape[1],
                                   torch.zeros(len(layers), 3, dtype=torch.long, device=device),
                                   cache=weakref.ref(self))

    def take_rows(self, part: StaticDecodeCache, first: int, batch: int) -> None:
        """Move the filled cache `part` of a prompt's rows `first ..` into this cache of `batch` rows: a
        batch prefilled a group of rows at a time (hf_decode_graph.py), the groups in order. Every part
        holds the same padded prompt length and capacity; `part` is emptied. The last group completes
        the cache: its statistics then count the whole batch's steps."""
        n = part.batch_size
        if not part.filled or first + n > batch or (first == 0) == self.filled:
            raise UsageError(f"take_rows: rows {first}..{first + n} of {batch} do not follow this cache's")
        if first == 0:  # the buffers of the whole batch, at the first part's shapes
            self.capacity = part.capacity
            self.keys = [k.new_zeros(batch, *k.shape[1:]) for k in part.keys]
            self.values = [v.new_zeros(batch, *v.shape[1:]) for v in part.values]
            self.state = [{name: t.new_zeros(batch, *t.shape[1:]) for name, t in layer.items()}
                          for layer in part.state]
            self.lens = part.lens.new_zeros(batch)
            self.length, self.controller, self.prompt_rows = part.length, part.controller, []
        elif part.length != self.length or part.capacity != self.capacity:
            raise UsageError("take_rows: the parts of one prompt must have its length and capacity")
        rows = slice(first, first + n)
        for mine, theirs in ((self.keys, part.keys), (self.values, part.values)):
            for index, x in enumerate(theirs):
                mine[index][rows] = x
                theirs[index] = None  # freed as it is copied
        for mine, theirs in zip(self.state, part.state, strict=True):
            for name, t in theirs.items():
                mine[name][rows] = t
        self.lens[rows] = part.lens
        self.prompt_rows += part.counts.rows
        self.longest = max(self.longest, part.longest)
        part.keys, part.values, part.state = [], [], []
        if first + n == batch:
            self.step_mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=self.lens.device)
            self.counts = StaticCounts(self.prompt_rows, part.counts.heads, part.counts.kv_heads,
                                       torch.zeros_like(part.counts.totals), cache=weakref.ref(self))
            self.controller.track_static(self)

    # ---- decode steps (host side)
    def plan_step(self) -> None:
        """Room and width for the next token (host integers only; the same answer until `step_done`)."""
        self.reserve(self.longest + 1)
        self.width = min(self.capacity, round_up(self.longest + 1, self.width_step))

    def step_done(self) -> None:
        """The host's half of a finished step (the device's, `lens += 1`, is inside the step)."""
        self.length += 1
        self.longest += 1
        self.counts.steps += 1

    def reserve(self, length: int) -> None:
        """Room for `length` tokens per row: larger buffers holding the old contents (a graph is dropped)."""
        if length <= self.capacity or not self.filled:
            self.capacity = max(self.capacity, length)
            return
        self.capacity = round_up(length, self.width_step)
        self.version += 1
        self.decode_graph = self.graph_key = None
        method = self.controller.method
        for index in range(len(self.keys)):
            self.keys[index] = _padded(self.keys[index], self.capacity)
            self.values[index] = _padded(self.values[index], self.capacity)
            if self.state[index]:
                self.state[index] = method.static_state(self.keys[index], self.lens, self.capacity,
                                                        self.state[index])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder every row along the batch for beam search (in place: a captured graph stays valid)."""
        tensors = [*self.keys, *self.values, self.lens, *(t for s in self.state for t in s.values())]
        for tensor in tensors:
            tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))


def _compact(x: Tensor, order: Tensor | None) -> Tensor:
    """`x` `[B, H, T, ...]` with each row's tokens in `order` `[B, T]` (None: as they are)."""
    if order is None:
        return x
    B, H, T = x.shape[:3]
    index = order.view(B, 1, T, *([1] * (x.dim() - 3))).expand(B, H, T, *x.shape[3:])
    return x.gather(2, index)


def _padded(x: Tensor, capacity: int) -> Tensor:
    """`x` `[B, H, n, D]` in the first n of `capacity` zeroed slots (zeros: a masked slot stays finite)."""
    if x.shape[2] == capacity:
        return x
    out = x.new_zeros(*x.shape[:2], capacity, *x.shape[3:])
    out[:, :, : x.shape[2]] = x
    return out

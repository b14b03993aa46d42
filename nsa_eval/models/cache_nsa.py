"""The generation cache of the NSA model: raw and compressed keys/values, per layer.

Per layer it keeps
- `k`, `v`        `[B, S, Hkv, Dk]` / `[B, S, Hkv, Dv]`: the selection branch's keys (rotated) and values;
- `k_swa`, `v_swa` the window branch's, only when branches have separate keys/values (`shared_kv=False`);
- `k_cmp`, `v_cmp` `[B, Sc, Hkv, D]`: compressed blocks, `Sc = 0 if S < l else (S - l) // d + 1`;
- `k_tail`, `v_tail`: the compression inputs from token `Sc * d` on, i.e. the raw tokens of blocks
  not yet complete; when a block completes it is compressed once and appended to `k_cmp`.

Every row of the batch has the same length: the NSA model does not take padded batches (the lm-eval
adapter generates row by row instead), so `cache_seqlens` is never needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (k_in [B, L, Hkv, Dk], v_in [B, L, Hkv, Dv], first_block) -> (k_cmp [B, n, Hkv, Dk], v_cmp [B, n, Hkv, Dv])
CompressFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def num_compressed(length: int, block_len: int, stride: int) -> int:
    """Compressed blocks over `length` tokens: 0 if length < l else (length - l) // d + 1."""
    return 0 if length < block_len else (length - block_len) // stride + 1


def _cat(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    if new is None:
        return old
    return new if old is None else torch.cat([old, new], dim=1)  # [B, S + T, H, D]


@dataclass
class NSALayerCache:
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_swa: torch.Tensor | None = None
    v_swa: torch.Tensor | None = None
    k_cmp: torch.Tensor | None = None
    v_cmp: torch.Tensor | None = None
    k_tail: torch.Tensor | None = None
    v_tail: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def num_cmp(self) -> int:
        return 0 if self.k_cmp is None else self.k_cmp.shape[1]

    def tensors(self) -> list[str]:
        return [name for name in self.__dataclass_fields__ if getattr(self, name) is not None]


class NSACache:
    """Raw and compressed keys/values of every layer; what `generate()` passes back to the model.

    `update` appends T new tokens and compresses any block they complete, so after it the cache
    holds exactly what a prefill over all S tokens would have computed.
    """

    is_compileable = False  # read by transformers' generate(); this cache grows dynamically

    def __init__(self, num_layers: int, block_len: int, stride: int):
        self.layers = [NSALayerCache() for _ in range(num_layers)]
        self.block_len = block_len
        self.stride = stride

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seq_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # unbounded

    def __len__(self) -> int:
        return len(self.layers)

    def update(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cmp_in: torch.Tensor,
        v_cmp_in: torch.Tensor,
        compress: CompressFn,
        k_swa: torch.Tensor | None = None,
        v_swa: torch.Tensor | None = None,
    ) -> NSALayerCache:
        """Append T new tokens to layer `layer_idx` and return the layer's cache.

        Args:
            k, v: new selection keys `[B, T, Hkv, Dk]` (rotated) and values `[B, T, Hkv, Dv]`.
            k_cmp_in, v_cmp_in: new compression inputs `[B, T, Hkv, D]` (what `compress` expects).
            compress: maps raw blocks starting at block `first_block` to compressed keys/values.
            k_swa, v_swa: new window keys/values `[B, T, Hkv, D]` when branches are separate.
        """
        layer = self.layers[layer_idx]
        layer.k, layer.v = _cat(layer.k, k), _cat(layer.v, v)  # [B, S, Hkv, D]
        layer.k_swa, layer.v_swa = _cat(layer.k_swa, k_swa), _cat(layer.v_swa, v_swa)
        layer.k_tail, layer.v_tail = _cat(layer.k_tail, k_cmp_in), _cat(layer.v_tail, v_cmp_in)
        done = layer.num_cmp
        tail_start = done * self.stride  # token index of layer.k_tail[:, 0]
        total = num_compressed(layer.seq_len, self.block_len, self.stride)
        if total > done:
            # raw tokens of blocks done..total-1: [done*d, (total-1)*d + l)
            end = (total - 1) * self.stride + self.block_len - tail_start
            k_new, v_new = compress(layer.k_tail[:, :end], layer.v_tail[:, :end], done)  # [B, n, Hkv, D]
            layer.k_cmp, layer.v_cmp = _cat(layer.k_cmp, k_new), _cat(layer.v_cmp, v_new)
            drop = (total - done) * self.stride  # the next block starts at total * d
            layer.k_tail, layer.v_tail = layer.k_tail[:, drop:], layer.v_tail[:, drop:]
        return layer

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder every tensor along the batch for beam search."""
        for layer in self.layers:
            for name in layer.tensors():
                tensor = getattr(layer, name)
                setattr(layer, name, tensor.index_select(0, beam_idx.to(tensor.device)))

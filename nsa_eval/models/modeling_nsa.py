"""A decoder-only language model whose attention is Native Sparse Attention, read top to bottom.

References:
- NSA: Yuan et al., "Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse
  Attention", arXiv 2502.11089 (Sec. 3.3 for the three branches and the gate, Sec. 4.1 for sizes).
- DeepSeekMoE (arXiv 2401.06066) for the optional mixture of experts, as in the paper's 27B model.
- fla-org/flash-linear-attention `fla/models/nsa` for the layout `convert_fla.py` loads.
- karpathy/nanoGPT `model.py` for the shape of this file.

Parts, in order of use: RMSNorm, rotary position embedding, block compression, the NSA attention
layer, the SwiGLU MLP and the mixture of experts, the decoder block, then the Hugging Face classes.

Shapes: B batch, T new tokens, S cached tokens, Hq query heads, Hkv key/value heads, G = Hq / Hkv,
Dk query/key head size, Dv value head size, C hidden size, Tc compressed blocks.

Where RoPE sits relative to compression (the paper does not say):
- `compression="mean"` pools keys that are already rotated, as fla does, so fla checkpoints match;
- `compression="mlp"` compresses keys before RoPE (the intra-block position embedding tells the MLP
  where each token sits in its block) and then rotates compressed key i at its block's first token
  position `i * stride`, as XunhaoLai/native-sparse-attention-triton does. Values are never rotated.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from nsa_eval.kernels import nsa_attention, nsa_decode
from nsa_eval.kernels.decode_compress import block_inputs, write_block
from nsa_eval.kernels.decode_inputs import decode_inputs
from nsa_eval.kernels.rms_norm import add_rms_norm
from nsa_eval.models.cache_nsa import (
    CAPACITY_STEP,
    DecodeStep,
    NSACache,
    NSALayerCache,
    num_compressed,
    round_capacity,
)
from nsa_eval.models.configuration_nsa import NSAConfig
from nsa_eval.models.decode_graph import DecodeGraph

try:  # transformers >= 5 initialises through functions that respect already-loaded weights
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    init = nn.init

# transformers 5.24 renamed the output field past_key_values -> cache; write whichever exists.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# A batch of prompts goes into the cache in groups of rows of about this many tokens in all (one row
# at a time from here up): the layers' intermediates then stay those of one long prompt, so that a
# batch of 16 at 64k fits beside its cache.
PREFILL_TOKENS = 65536


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# --- rotary position embedding (GPT-NeoX "rotate half" layout, as Llama and fla use) ---


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos, sin `[T, dim]` for integer `positions` `[T]`; computed on the fly, so no buffers to load."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, T, H, D]` by cos/sin `[T, D]`."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LayerShared(dict):
    """What every layer of one forward works out alike (the tokens' positions, the rotary tables), worked
    out by the first layer that asks and reused by the rest: a decode step's dozens of small kernels for
    them run once instead of once per layer."""

    def get_or(self, key, compute):
        if key not in self:
            self[key] = compute()
        return self[key]


# --- compression: l raw tokens, d apart, -> one compressed key or value (paper Eq. 7) ---


class BlockCompressor(nn.Module):
    """phi of the paper: each block of `block_len` tokens (blocks start `stride` apart) -> one vector.

    "mlp": add a learned intra-block position embedding `[l, D]`, flatten the block to `l * D` and
    apply Linear-SiLU-Linear back to D. "mean": a parameter-free mean (fla's mean pooling).
    """

    def __init__(self, config: NSAConfig, dim: int):
        super().__init__()
        self.mode, self.block_len, self.stride = config.compression, config.block_len, config.stride
        if self.mode == "mlp":
            self.pos_emb = nn.Parameter(torch.zeros(config.block_len, dim))
            self.fc1 = nn.Linear(config.block_len * dim, config.compress_hidden_size, bias=False)
            self.fc2 = nn.Linear(config.compress_hidden_size, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, L, H, D]` -> `[B, Tc, H, D]`, Tc = 0 if L < l else (L - l) // d + 1."""
        B, L, H, D = x.shape
        if L < self.block_len:
            return x.new_zeros(B, 0, H, D)
        blocks = x.unfold(1, self.block_len, self.stride)  # [B, Tc, H, D, l]
        if self.mode == "mean":
            return blocks.mean(dim=-1)  # [B, Tc, H, D]
        blocks = blocks.transpose(-1, -2) + self.pos_emb  # [B, Tc, H, l, D]
        return self.fc2(F.silu(self.fc1(blocks.flatten(-2))))  # [B, Tc, H, D]


# --- the NSA attention layer ---

# the per-token tensors the cache keeps (the window's for the last `window` tokens, the compression
# inputs for the last block_len)
CACHED = ("k", "v", "k_swa", "v_swa", "k_cmp_in", "v_cmp_in")


class NSAAttention(nn.Module):
    """GQA attention replaced by NSA: o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa (paper Eq. 5).

    Projections: `q_proj`; `k_proj`/`v_proj` feed selection (and everything when `shared_kv`);
    with separate branches also `k_cmp_proj`/`v_cmp_proj` (compression input) and
    `k_swa_proj`/`v_swa_proj` (window). `g_proj` gives three sigmoid gates per query head, laid out
    `(head, branch)` with branches (cmp, slc, swa) as fla's g_proj.
    """

    def __init__(self, config: NSAConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        C, Hq, Hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        Dk, Dv, bias = config.head_dim, config.v_head_dim, config.attention_bias
        self.Hq, self.Hkv, self.Dk, self.Dv = Hq, Hkv, Dk, Dv
        self.q_proj = nn.Linear(C, Hq * Dk, bias=bias)
        self.k_proj = nn.Linear(C, Hkv * Dk, bias=bias)
        self.v_proj = nn.Linear(C, Hkv * Dv, bias=bias)
        if not config.shared_kv:
            self.k_cmp_proj = nn.Linear(C, Hkv * Dk, bias=bias)
            self.v_cmp_proj = nn.Linear(C, Hkv * Dv, bias=bias)
            if config.window > 0:
                self.k_swa_proj = nn.Linear(C, Hkv * Dk, bias=bias)
                self.v_swa_proj = nn.Linear(C, Hkv * Dv, bias=bias)
        if config.gate_hidden_size:
            self.g_proj = nn.Sequential(
                nn.Linear(C, config.gate_hidden_size, bias=False),
                nn.SiLU(),
                nn.Linear(config.gate_hidden_size, 3 * Hq, bias=False),
            )
        else:
            self.g_proj = nn.Linear(C, 3 * Hq, bias=False)
        self.compress_k = BlockCompressor(config, Dk)
        self.compress_v = BlockCompressor(config, Dv)
        self.k_cmp_norm = RMSNorm(Dk, config.rms_norm_eps) if config.compress_norm else None
        self.o_proj = nn.Linear(Hq * Dv, C, bias=False)
        self.selected_tokens: torch.Tensor | None = None  # [B, T, Hkv] of the last call (num_local = 0)
        # while a list (`NSAModel.recording_selections`): each prefill appends its block indices
        self.recorded_blocks: list[torch.Tensor] | None = None
        # while a list (`NSAModel.capturing_selection_inputs`): each prefill appends (q, k, k_cmp)
        self.selection_inputs: list[tuple[torch.Tensor, ...]] | None = None
        self._decode_weight: tuple | None = None  # (key, weight, bias, gate column): `decode_weight`'s

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.Dk, self.config.rope_theta, dtype)

    def compress(self, k_in: torch.Tensor, v_in: torch.Tensor, first_block: int | torch.Tensor,
                 shared: LayerShared | None = None):
        """Inputs `[B, L, Hkv, D]` from block `first_block` (an int, or int64 `[1]` on the device, the same
        object for every layer of a forward) on -> k_cmp, v_cmp `[B, Tc, Hkv, D]`."""
        return self.compress_keys(k_in, first_block, shared), self.compress_v(v_in)

    def compress_keys(self, k_in: torch.Tensor, first_block: int | torch.Tensor,
                      shared: LayerShared | None = None) -> torch.Tensor:
        """`compress`'s keys alone: `[B, L, Hkv, Dk]` -> k_cmp `[B, Tc, Hkv, Dk]`."""
        k_cmp = self.compress_k(k_in)
        if self.k_cmp_norm is not None:
            k_cmp = self.k_cmp_norm(k_cmp)
        if self.config.compression == "mlp":  # rotate compressed key i at its first token, i * stride
            cos, sin = self.block_rope(first_block, k_cmp.shape[1], k_cmp.dtype, k_cmp.device, shared)
            k_cmp = apply_rope(k_cmp, cos, sin)
        return k_cmp

    def block_rope(self, first_block: int | torch.Tensor, Tc: int, dtype: torch.dtype, device: torch.device,
                   shared: LayerShared | None = None):
        """cos, sin `[Tc, Dk]` of compressed blocks `first_block ..` (each at its first token, i * stride),
        worked out once per forward (`shared`)."""

        def tables():
            block_ids = first_block + torch.arange(Tc, device=device)
            return self.rope(block_ids * self.config.stride, dtype)

        where = first_block if isinstance(first_block, int) else id(first_block)
        shared = LayerShared() if shared is None else shared  # an empty one is falsy: no `or`
        return shared.get_or(("rope of blocks", where, Tc, dtype), tables)

    def project(self, x: torch.Tensor, positions: torch.Tensor, shared: LayerShared | None = None) -> dict:
        """Hidden states `[B, T, C]` at `positions` `[T]` -> every per-branch tensor the kernels need.

        All come out in the value projection's dtype: the model's, or autocast's under autocast. There
        the residual stream stays fp32, so RoPE (with cos/sin in x's dtype) and the fp32 gates would
        otherwise hand the kernels fp32 q/k beside a bf16 v, which they refuse.
        """
        B, T, _ = x.shape
        Hq, Hkv, Dk, Dv = self.Hq, self.Hkv, self.Dk, self.Dv
        shared = LayerShared() if shared is None else shared
        cos, sin = shared.get_or(("rope", x.dtype), lambda: self.rope(positions, x.dtype))
        v = self.v_proj(x).view(B, T, Hkv, Dv)  # [B, T, Hkv, Dv]
        dtype = v.dtype
        q = apply_rope(self.q_proj(x).view(B, T, Hq, Dk), cos, sin).to(dtype)  # [B, T, Hq, Dk]
        k_raw = self.k_proj(x).view(B, T, Hkv, Dk)  # [B, T, Hkv, Dk], before RoPE
        k = apply_rope(k_raw, cos, sin).to(dtype)
        if self.config.shared_kv:
            k_cmp_in, v_cmp_in, k_swa, v_swa = k_raw, v, None, None
        else:
            k_cmp_in = self.k_cmp_proj(x).view(B, T, Hkv, Dk)
            v_cmp_in = self.v_cmp_proj(x).view(B, T, Hkv, Dv)
            k_swa = v_swa = None
            if self.config.window > 0:
                k_swa = apply_rope(self.k_swa_proj(x).view(B, T, Hkv, Dk), cos, sin).to(dtype)
                v_swa = self.v_swa_proj(x).view(B, T, Hkv, Dv)
        if self.config.compression == "mean":  # fla pools rotated keys
            k_cmp_in = apply_rope(k_cmp_in, cos, sin)
        k_cmp_in, v_cmp_in = k_cmp_in.to(dtype), v_cmp_in.to(dtype)
        gates = torch.sigmoid(self.g_proj(x).float()).view(B, T, Hq, 3).to(dtype)  # [B, T, Hq, 3]
        g_cmp, g_slc, g_swa = gates.unbind(-1)  # [B, T, Hq] each
        if self.config.window == 0:
            g_swa = torch.zeros_like(g_swa)  # no window branch: its output is multiplied by 0
        return dict(q=q, k=k, v=v, k_cmp_in=k_cmp_in, v_cmp_in=v_cmp_in, k_swa=k_swa, v_swa=v_swa,
                    g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa)

    def detached_compressed_keys(self, x: torch.Tensor, dtype: torch.dtype,
                                 shared: LayerShared) -> torch.Tensor:
        """The compressed keys of the prompt `x` `[B, T, C]`, computed again from `x` detached, in `dtype`
        (the branches' as `project` gave them): `[B, Tc, Hkv, Dk]`. A loss on them
        (`NSAModel.capturing_selection_inputs`) then trains the compressor and the key projection into it,
        and nothing before the layer. `shared` holds `project`'s rotary tables."""
        B, T, _ = x.shape
        proj = self.k_proj if self.config.shared_kv else self.k_cmp_proj
        k_in = proj(x.detach()).view(B, T, self.Hkv, self.Dk)
        if self.config.compression == "mean":  # rotated as `project` rotates them
            k_in = apply_rope(k_in, *shared[("rope", x.dtype)])
        return self.compress_keys(k_in.to(dtype), 0, shared).to(dtype)

    @property
    def counts_selected_blocks(self) -> bool:
        """With num_local = 0 the query's own block competes on score, so the selected-token count
        depends on the data: the layer then counts the tokens of the blocks the kernel selected."""
        return self.config.num_local == 0

    def kernel_kwargs(self) -> dict:
        kwargs = self.config.nsa_kwargs()
        kwargs["window"] = max(kwargs["window"], 1)  # window 0 runs a 1-token window gated by 0
        return kwargs

    def prefill(self, p: dict, cache: NSACache | None, rows: slice = slice(None),
                shared: LayerShared | None = None) -> torch.Tensor:
        """All T queries at once from position 0 (training, scoring, the prompt), written to the cache's
        batch rows `rows`: `[B, T, Hq, Dv]`."""
        k_cmp, v_cmp = self.compress(p["k_cmp_in"], p["v_cmp_in"], 0, shared)  # [B, Tc, Hkv, D]
        k_cmp, v_cmp = k_cmp.to(p["v"].dtype), v_cmp.to(p["v"].dtype)  # the MLP compressor may autocast
        if cache is not None:
            cache.prefill(self.layer_idx, {name: p[name] for name in CACHED}, k_cmp, v_cmp, rows)
        recording = self.recorded_blocks is not None
        out = nsa_attention(p["q"], p["k"], p["v"], k_cmp, v_cmp, p["g_cmp"], p["g_slc"], p["g_swa"],
                            k_swa=p["k_swa"], v_swa=p["v_swa"],
                            return_block_indices=self.counts_selected_blocks or recording,
                            **self.kernel_kwargs())
        if not (self.counts_selected_blocks or recording):
            return out
        o, blocks = out  # blocks [B, T, Hkv, n]
        if recording:
            self.recorded_blocks.append(blocks)
        if self.counts_selected_blocks:
            T = p["q"].shape[1]
            self.selected_tokens = selected_tokens(torch.arange(T, device=blocks.device), blocks,
                                                   self.config.select_size)  # [B, T, Hkv]
        return o

    def decode(self, p: dict, cache: NSACache, shared: LayerShared | None = None) -> torch.Tensor:
        """T new queries after the cached tokens, one at a time through nsa_decode: `[B, T, Hq, Dv]`.

        On the GPU the Triton kernels read the whole buffers and take the length from the device, so a
        step is the same launches at every position (a CUDA graph replays it, nothing recompiles); the
        reference reads the written rows only.
        """
        outputs, counts = [], []
        B = p["q"].shape[0]
        for t in range(p["q"].shape[1]):
            step = {name: None if x is None else x[:, t : t + 1] for name, x in p.items()}
            where = cache.step(t, step["q"].device, B)  # position and rows, on this layer's GPU
            new = {name: step[name] for name in CACHED}
            layer = cache.decode(self.layer_idx, where, new,
                                 lambda k_in, v_in, first: self.compress(k_in, v_in, first, shared))
            out, count = self._attend(step["q"], step["g_cmp"], step["g_slc"], step["g_swa"], layer, cache,
                                      where, t)
            outputs.append(out)
            counts.append(count)
        if self.counts_selected_blocks:
            self.selected_tokens = torch.cat(counts, dim=1)  # [B, T, Hkv]
        return torch.cat(outputs, dim=1)  # [B, T, Hq, Dv]

    def _attend(self, q, g_cmp, g_slc, g_swa, layer: NSALayerCache, cache: NSACache, where: DecodeStep,
                t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's token `t`, written to the cache (`layer`, at `where`), attends through nsa_decode:
        q `[B, 1, Hq, Dk]`, gates `[B, 1, Hq]` -> `[B, 1, Hq, Dv]`, and its selected tokens `[B, 1, Hkv]`
        where the layer counts them (else None)."""
        if q.is_cuda and self.config.kernel_impl != "reference":
            rows, rows_cmp = cache.capacity, cache.capacity_cmp
            lens = where.lens
        else:
            rows = cache.length + t + 1
            rows_cmp, lens = num_compressed(rows, cache.block_len, cache.stride), None
        # one dtype for the kernel, even if the cache was filled under another autocast setting; the
        # window's ring whole (token p in row p % window)
        k, v, k_cmp, v_cmp, k_swa, v_swa = (
            None if x is None else x[:, :n].to(q.dtype) for x, n in (
                (layer.k, rows), (layer.v, rows), (layer.k_cmp, rows_cmp), (layer.v_cmp, rows_cmp),
                (layer.k_swa, None), (layer.v_swa, None)))
        out = nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, cache_seqlens=lens, k_swa=k_swa,
                         v_swa=v_swa, return_block_indices=self.counts_selected_blocks,
                         **self.kernel_kwargs())
        if not self.counts_selected_blocks:
            return out, None
        out, blocks = out  # blocks [B, 1, Hkv, n]
        return out, selected_tokens(where.pos, blocks, self.config.select_size)  # [B, 1, Hkv]

    def decode_weight(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The fused decode's one projection: the weights of q, k, v, the branches' own k, v (where the
        layer has them) and a one-Linear g_proj, stacked `[N, C]` in that order (`decode_inputs`' layout),
        the bias `[N]` (None without `attention_bias`), and the column where the gate logits start (N
        when g_proj is an MLP, which runs on its own).

        Built on first use and again when a source weight changes (its address, version or dtype). It is a
        copy beside the parameters (not a buffer: nothing of it is saved or loaded), the price of one GEMM
        where there were up to eight.
        """
        linears = [self.q_proj, self.k_proj, self.v_proj]
        if not self.config.shared_kv:
            linears += [self.k_cmp_proj, self.v_cmp_proj]
            if self.config.window > 0:
                linears += [self.k_swa_proj, self.v_swa_proj]
        gate_fused = isinstance(self.g_proj, nn.Linear)
        if gate_fused:
            linears.append(self.g_proj)
        key = tuple((p.data_ptr(), p._version, p.dtype) for m in linears for p in m.parameters())
        if self._decode_weight is None or self._decode_weight[0] != key:
            with torch.no_grad():
                weight = torch.cat([m.weight for m in linears])  # [N, C]
                bias = None
                if any(m.bias is not None for m in linears):  # g_proj has none: zeros in its place
                    bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias
                                      for m in linears])  # [N]
            gate_column = weight.shape[0] - (3 * self.Hq if gate_fused else 0)
            self._decode_weight = (key, weight, bias, gate_column)
        return self._decode_weight[1:]

    def decode_token(self, x: torch.Tensor, cache: NSACache,
                     shared: LayerShared | None = None) -> torch.Tensor:
        """One decode token per row through the fused launches (`NSAModel`'s fused decode): normalised
        hidden states `x` `[B, 1, C]` -> the layer's output `[B, 1, C]`, the token written to the cache.

        What `forward` computes for T = 1 after a prompt, within rounding: one GEMM for every projection
        (`decode_weight`), one `decode_inputs` launch for RoPE, the gates and the cache writes, the block
        the token completes compressed around two launches (`_compress_token`; skipped when the host's
        length says the token completes none), then nsa_decode as the unfused step runs it.
        """
        B = x.shape[0]
        shared = LayerShared() if shared is None else shared
        positions = shared.get_or(
            "positions", lambda: cache.position.to(x.device) + torch.arange(1, device=x.device))
        cos, sin = shared.get_or(("rope", x.dtype), lambda: self.rope(positions, x.dtype))  # [1, Dk] each
        weight, bias, gate_column = self.decode_weight()
        y = F.linear(x.view(B, -1), weight, bias)  # [B, N]
        # [B, 3 Hq] gate logits: y's last columns, or g_proj's own MLP
        g = y[:, gate_column:] if gate_column < y.shape[1] else self.g_proj(x).view(B, 3 * self.Hq)
        where = cache.step(0, x.device, B)
        layer = cache.layers[self.layer_idx]
        q, g_cmp, g_slc, g_swa = decode_inputs(
            y, g, cos, sin, layer.k, layer.v, layer.k_cmp_in, layer.v_cmp_in, where.pos, where.cmp_in_row,
            k_swa=layer.k_swa, v_swa=layer.v_swa, window_row=where.window_row,
            shared_kv=self.config.shared_kv, rope_cmp_in=self.config.compression == "mean",
            gate_swa=self.config.window > 0)
        if cache.completes_block():
            self._compress_token(layer, where, shared)
        o, count = self._attend(q, g_cmp, g_slc, g_swa, layer, cache, where, 0)  # [B, 1, Hq, Dv]
        if self.counts_selected_blocks:
            self.selected_tokens = count  # [B, 1, Hkv]
        return self.o_proj(o.view(B, 1, self.Hq * self.Dv))  # [B, 1, C]

    def _compress_token(self, layer: NSALayerCache, where: DecodeStep, shared: LayerShared) -> None:
        """`NSACache.compress_token` in fewer launches: the block ending at the token gathered from the ring
        (`block_inputs`), through the compressor's MLP, normed, rotated and written (`write_block`)."""
        ck, cv = self.compress_k, self.compress_v
        mlp = self.config.compression == "mlp"
        pos_emb = (ck.pos_emb, cv.pos_emb) if mlp else ()
        k_blk, v_blk = block_inputs(layer.k_cmp_in, layer.v_cmp_in, where.block_rows, *pos_emb)  # [B, Hkv, .]
        cos = sin = None
        if mlp:
            k_blk, v_blk = ck.fc2(F.silu(ck.fc1(k_blk))), cv.fc2(F.silu(cv.fc1(v_blk)))  # [B, Hkv, D]
            cos, sin = self.block_rope(where.first_block, 1, k_blk.dtype, k_blk.device, shared)  # [1, Dk]
        norm = self.k_cmp_norm
        write_block(k_blk, v_blk, layer.k_cmp, layer.v_cmp, where.cmp_row,
                    norm_weight=None if norm is None else norm.weight, eps=self.config.rms_norm_eps,
                    cos=cos, sin=sin)

    def forward(self, x: torch.Tensor, cache: NSACache | None = None, rows: slice = slice(None),
                shared: LayerShared | None = None) -> torch.Tensor:
        """x `[B, T, C]` -> `[B, T, C]`; a prompt's keys/values go to the cache's batch rows `rows`. `shared`:
        what the forward's other layers worked out already (`LayerShared`)."""
        B, T, _ = x.shape
        shared = LayerShared() if shared is None else shared
        if cache is None or cache.length == 0:
            positions = shared.get_or("positions", lambda: torch.arange(T, device=x.device))
            p = self.project(x, positions, shared)
            if self.selection_inputs is not None:
                self.selection_inputs.append((p["q"], p["k"],
                                             self.detached_compressed_keys(x, p["v"].dtype, shared)))
            o = self.prefill(p, cache, rows, shared)  # [B, T, Hq, Dv]
        else:
            positions = shared.get_or(
                "positions", lambda: cache.position.to(x.device) + torch.arange(T, device=x.device))
            p = self.project(x, positions, shared)
            o = self.decode(p, cache, shared)
        del p  # every branch's keys/values of T tokens: freed before the output projection allocates
        return self.o_proj(o.reshape(B, T, self.Hq * self.Dv))  # [B, T, C]


# --- feed-forward: SwiGLU, and DeepSeekMoE (routed + shared experts) ---


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """DeepSeekMoE: top-k of `num_experts` routed experts (softmax router) plus always-on shared experts.

    The shared experts are one SwiGLU `num_shared_experts` times as wide (the same function as a sum
    of separate experts). `aux_loss` holds the load-balancing loss of the last call.
    """

    def __init__(self, config: NSAConfig):
        super().__init__()
        C, E, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.router = nn.Linear(C, E, bias=False)
        self.experts = nn.ModuleList([SwiGLU(C, width) for _ in range(E)])
        shared = config.num_shared_experts
        self.shared_experts = SwiGLU(C, width * shared) if shared else None
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # [N, C]
        probs = self.router(flat).float().softmax(dim=-1)  # [N, E]
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (top_i == e).nonzero(as_tuple=True)  # tokens routed to expert e, each once
            if rows.numel():
                out[rows] += expert(flat[rows]) * top_p[rows, slot, None].to(flat.dtype)  # [n, C]
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        # Switch-style balance loss: E * sum_e (fraction of tokens to e) * (mean router prob of e)
        load = F.one_hot(top_i, len(self.experts)).float().sum(dim=(0, 1)) / top_i.numel()  # [E]
        self.aux_loss = len(self.experts) * (load * probs.mean(dim=0)).sum()
        return out.view(B, T, C)


class NSABlock(nn.Module):
    def __init__(self, config: NSAConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = NSAAttention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        use_moe = config.num_experts > 0 and layer_idx >= config.first_dense_layers
        self.mlp = MoE(config) if use_moe else SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cache: NSACache | None = None, rows: slice = slice(None),
                shared: LayerShared | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache, rows, shared)
        return x + self.mlp(self.mlp_norm(x))


# --- activated tokens per query, for comparing NSA with the baselines' budgets ---


def activated_tokens(positions: torch.Tensor, config: NSAConfig) -> dict[str, torch.Tensor]:
    """Tokens each query at `positions` `[N]` (0-based) attends to, per branch, as `[N]` int64 tensors.

    compressed: blocks complete by the query, 0 if t + 1 < l else (t + 1 - l) // d + 1;
    selected: the raw tokens of min(n, blocks so far) selection blocks, the query's own block
    counting only its first t mod l' + 1 tokens. Exact when num_local >= 1 (the own block is always
    selected) or when the query has at most n blocks (all are selected). With num_local = 0 and more
    than n blocks the own block competes on score, so the count depends on the data: this gives the
    upper bound n * l' (own block not selected); the model counts the blocks its kernel selected
    instead (`selected_tokens`).
    window: min(w, t + 1). `total` is their sum, the paper's Table 4 count (tokens in both the
    window and a selected block count twice, as they are loaded twice).
    """
    t = positions.long()
    l, d, ls, n = config.block_len, config.stride, config.select_size, config.num_selected
    seen = t + 1
    compressed = torch.where(seen < l, torch.zeros_like(t), torch.div(seen - l, d, rounding_mode="floor") + 1)
    available = torch.div(t, ls, rounding_mode="floor") + 1  # blocks starting at or before t
    blocks = torch.clamp(available, max=n)
    selected = (blocks - 1) * ls + torch.remainder(t, ls) + 1  # own block selected
    if config.num_local == 0:
        selected = torch.where(available <= n, selected, n * ls)
    window = torch.clamp(seen, max=config.window) if config.window > 0 else torch.zeros_like(t)
    return dict(compressed=compressed, selected=selected, window=window, total=compressed + selected + window)


def selected_tokens(positions: torch.Tensor, block_indices: torch.Tensor, select_size: int) -> torch.Tensor:
    """Raw tokens the selection branch reads: `block_indices` `[B, T, Hkv, n]` (the kernel's, -1 padded,
    ascending) of queries at `positions` `[T]` -> `[B, T, Hkv]` int64, each block counting its tokens
    up to the query (the kernel's token-level causal mask) and repeated blocks once."""
    idx = block_indices.long()  # [B, T, Hkv, n]
    t = positions.long().to(idx.device)[None, :, None, None]  # [1, T, 1, 1]
    tokens = torch.clamp(t - idx * select_size + 1, min=0, max=select_size)  # [B, T, Hkv, n]
    use = idx >= 0
    use[..., 1:] &= idx[..., 1:] != idx[..., :-1]  # ascending: a repeat sits next to its first copy
    return (tokens * use).sum(-1)  # [B, T, Hkv]


BRANCHES = ("total", "compressed", "selected", "window")


def _summarise(tallies: list[dict[str, int]]) -> dict:
    queries = sum(t["queries"] for t in tallies)
    mean = {b: sum(t[b] for t in tallies) / queries if queries else 0.0 for b in BRANCHES}
    return {"queries": queries, "mean": mean["total"], "max": max((t["max"] for t in tallies), default=0),
            "kv_read_mean": mean["total"],  # the GQA group shares its blocks: KV read = tokens attended
            "mean_per_branch": {b: mean[b] for b in BRANCHES[1:]}}


# --- the Hugging Face classes ---


class NSAPreTrainedModel(PreTrainedModel):
    config_class = NSAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["NSABlock"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, BlockCompressor) and module.mode == "mlp":
            init.normal_(module.pos_emb, mean=0.0, std=self.config.initializer_range)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not build a DynamicCache: the model builds its NSACache


class NSAModel(NSAPreTrainedModel):
    def __init__(self, config: NSAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([NSABlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Decode steps on the GPU replay a CUDA graph captured over the cache's buffers (set False to
        # run every step eagerly, e.g. to profile its launches).
        self.decode_cuda_graph = True
        # Decode steps on the GPU run the fused launches (`_decode_layers`; set False for the unfused
        # layers, e.g. to compare the two).
        self.fuse_decode = True
        self.reset_attention_stats()
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def reset_attention_stats(self) -> None:
        self._tallies: dict[str, dict[str, int]] = {}  # phase -> running sums

    def attention_stats(self) -> dict:
        """Activated tokens per query since the last reset, in the shape of `methods.attention_stats`.

        `queries` counts (query, query head) pairs over all layers (every layer and head of NSA
        activates the same count); `mean`/`max` are tokens per query (`activated_tokens`'s total),
        `mean_per_branch` splits the mean, `phases` gives the same for prefill and decode calls.
        """
        summary = _summarise(list(self._tallies.values()))
        summary["phases"] = {phase: _summarise([t]) for phase, t in sorted(self._tallies.items())}
        summary["method"] = "nsa"
        summary["params"] = {k: getattr(self.config, k) for k in (
            "block_len", "stride", "select_size", "num_selected", "num_init", "num_local", "window")}
        return summary

    @contextmanager
    def attention_stats_paused(self):
        """Forward passes inside the block are not counted (e.g. lm-eval's batch-size probe)."""
        saved = self._tallies
        self._tallies = {}
        try:
            yield
        finally:
            self._tallies = saved

    def recording_selections(self):
        """Within the block every prefill's selection is kept: yields one list per layer that each
        forward over a prompt appends its block indices to, `[B, T, Hkv, num_selected]` int32 (ascending,
        -1 padded), the blocks of `select_size` tokens each query's selection branch attended to."""
        return self._collecting("recorded_blocks")

    def capturing_selection_inputs(self):
        """Within the block every prefill's selection inputs are kept: yields one list per layer that each
        forward over a prompt appends its queries `[B, T, Hq, Dk]` and selection keys `[B, T, Hkv, Dk]`, as
        the forward computed them, and compressed keys `[B, Tc, Hkv, Dk]` whose gradient reaches the
        compressor and its key projection alone (`NSAAttention.detached_compressed_keys`), for a loss on
        the selection (`nsa_eval.train.selection_distill`)."""
        return self._collecting("selection_inputs")

    @contextmanager
    def _collecting(self, attribute: str):
        # every layer's attention gets an empty list at `attribute` (its prefill appends to it), None after
        layers = [layer.attn for layer in self.layers]
        for attn in layers:
            setattr(attn, attribute, [])
        try:
            yield [getattr(attn, attribute) for attn in layers]
        finally:
            for attn in layers:
                setattr(attn, attribute, None)

    def _record(self, real: torch.Tensor, positions: torch.Tensor, phase: str,
                selected: torch.Tensor | None = None) -> None:
        """Tally the queries at `positions` `[T]` of the rows where `real` `[B, T]` is True.

        `selected`: `[layers, B, T, Hkv]` selected tokens counted from the kernel's blocks, or None
        for `activated_tokens`' formula (the same for every layer and head).
        """
        counts = activated_tokens(positions.cpu(), self.config)  # [T] each
        real = real.cpu()
        heads, layers = self.config.num_attention_heads, self.config.num_hidden_layers
        tally = self._tallies.setdefault(phase, dict.fromkeys(("queries", "max", *BRANCHES), 0))
        rows = real.sum(0)  # [T] real rows per position
        if not bool(rows.any()):
            return
        tally["queries"] += heads * layers * int(rows.sum())
        for name in ("compressed", "window"):
            tally[name] += heads * layers * int((counts[name] * rows).sum())
        if selected is None:
            tally["selected"] += heads * layers * int((counts["selected"] * rows).sum())
            totals = counts["total"][rows > 0]  # [T']
        else:
            selected = selected.cpu().long()  # [L, B, T, Hkv]
            group = heads // selected.shape[-1]  # query heads sharing each KV head's blocks
            selected = selected * real[None, :, :, None]
            tally["selected"] += group * int(selected.sum())
            totals = (counts["compressed"] + counts["window"])[:, None] + selected  # [L, B, T, Hkv]
            totals = totals[real[None, :, :, None].expand_as(totals)]
        tally["total"] = tally["compressed"] + tally["selected"] + tally["window"]
        tally["max"] = max(tally["max"], int(totals.max()))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: NSACache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, C]")

        def embed(rows: slice = slice(None)) -> torch.Tensor:  # the rows' inputs [b, T, C]
            return self.embed_tokens(input_ids[rows]) if inputs_embeds is None else inputs_embeds[rows]

        B, T = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, NSACache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"NSAModel needs an NSACache, got a filled {type(cache).__name__}")
            cache = None  # an empty cache of another kind (e.g. generate's DynamicCache): replace it
        if cache is None and use_cache:
            c = self.config
            own_window = c.window if not c.shared_kv and c.window > 0 else 0  # rows of the window's ring
            cache = NSACache(c.num_hidden_layers, c.block_len, c.stride, own_window)
        real = torch.ones(B, T, dtype=torch.bool)  # [B, T] queries to count in the statistics
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            real = attention_mask[:, -T:].bool().cpu()
            right_padded = bool((real.cummin(dim=1).values == real).all())  # ones, then only zeros
            if cache is not None or not right_padded:
                raise ValueError(
                    "NSAModel does not take padded batches (attention_mask has zeros) except right padding "
                    "without a cache (use_cache=False, as in scoring): NSA blocks are fixed token positions, "
                    "so run rows of different lengths separately"
                )
            # right padding sits after every real token of its row: causal attention never reads it
        past = cache.get_seq_length() if cache is not None else 0
        device = self.embed_tokens.weight.device if inputs_embeds is None else inputs_embeds.device
        if cache is not None:
            cache.begin(T, device, B)
        rows_at_once = max(1, PREFILL_TOKENS // T)
        if past and T == 1 and self._graph_ready(device):
            x = embed()  # [B, 1, C]
            kind = cache.completes_block()  # the step with the compressor, or the one without
            graph = cache.decode_graphs.get(kind)
            if graph is None:  # this step runs eagerly (it loads the kernels), then is captured
                hidden, selected = self._step(x, cache)
                try:
                    cache.decode_graphs[kind] = DecodeGraph(lambda h: self._step(h, cache), x)
                except RuntimeError as error:  # this step's answer stands; later steps run eagerly
                    warnings.warn("NSA decode steps run eagerly: capturing one as a CUDA graph failed "
                                  f"({error})", stacklevel=2)
                    self.decode_cuda_graph = False
            else:
                hidden, selected = graph(x)
            hidden = hidden.clone()  # the graph's output buffer is overwritten by the next step
        elif cache is not None and not past and B > rows_at_once and not torch.is_grad_enabled():
            hidden, selected = self._prefill_in_groups(embed, cache, rows_at_once)
        else:
            hidden, selected = self._step(embed(), cache)
        if cache is not None:
            cache.end(T)
        self._record(real, torch.arange(past, past + T), "prefill" if T > 1 else "decode", selected)
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{CACHE_FIELD: cache})

    def _step(self, x: torch.Tensor, cache: NSACache | None,
              fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of `x` `[B, T, C]` through the stack and the cache (what a CUDA graph captures).
        `fused`: whether a decode step takes `_decode_layers` (default: where `_fuses_decode` says)."""
        if cache is not None:
            cache.open_forward()
        fused = self._fuses_decode(x, cache) if fused is None else fused
        out = self._decode_layers(x, cache) if fused else self._layers(x, cache)
        if cache is not None:
            cache.advance(x.shape[1])
        return out

    def _prefill_in_groups(self, embed, cache: NSACache, rows_at_once: int):
        """A prompt batch into an empty cache, `rows_at_once` rows at a time: the layers' intermediates
        (the MLP's, the attention's) are those of about `PREFILL_TOKENS` tokens, not of the whole batch.
        `embed(rows)` gives those rows' inputs `[b, T, C]`. Returns what `_step` returns."""
        cache.open_forward()
        hidden, selected = None, []
        for b0 in range(0, cache.batch, rows_at_once):
            rows = slice(b0, b0 + rows_at_once)
            h, s = self._layers(embed(rows), cache, rows)
            if hidden is None:
                hidden = h.new_empty(cache.batch, *h.shape[1:])  # [B, T, C]
            hidden[rows] = h
            selected.append(s)
        cache.advance(hidden.shape[1])
        return hidden, torch.cat(selected, dim=1) if selected[0] is not None else None

    def _layers(self, x: torch.Tensor, cache: NSACache | None,
                rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack on `x` `[B, T, C]` (a prompt written to the cache's batch rows `rows`) ->
        normalised hidden states `[B, T, C]` and, when the layers count their selected blocks,
        `[layers, B, T, Hkv]` selected tokens (else None)."""
        per_block = self.layers[0].attn.counts_selected_blocks if len(self.layers) else False
        selected, shared = [], LayerShared()
        for layer in self.layers:
            x = layer(x, cache, rows, shared)
            if per_block:
                selected.append(layer.attn.selected_tokens)  # [B, T, Hkv]
                layer.attn.selected_tokens = None
        return self.norm(x), torch.stack(selected) if selected else None

    def _decode_layers(self, x: torch.Tensor, cache: NSACache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_layers` for one decode token per row `x` `[B, 1, C]`, in fewer launches: each residual add goes
        with the norm after it (`add_rms_norm`: the MLP's output with the next layer's attn_norm, the last
        with the final norm) and the attention runs `NSAAttention.decode_token`. Returns what `_layers`
        returns."""
        per_block = self.layers[0].attn.counts_selected_blocks
        selected, shared = [], LayerShared()
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]  # the norm after each layer
        h, y = add_rms_norm(x, None, self.layers[0].attn_norm.weight, self.layers[0].attn_norm.eps)
        for layer, norm in zip(self.layers, norms, strict=True):
            h, y = add_rms_norm(h, layer.attn.decode_token(y, cache, shared), layer.mlp_norm.weight,
                                layer.mlp_norm.eps)
            h, y = add_rms_norm(h, layer.mlp(y), norm.weight, norm.eps)
            if per_block:
                selected.append(layer.attn.selected_tokens)  # [B, 1, Hkv]
                layer.attn.selected_tokens = None
        return y, torch.stack(selected) if selected else None

    def _fuses_decode(self, x: torch.Tensor, cache: NSACache | None) -> bool:
        """Whether a forward of `x` `[B, T, C]` takes the fused decode (`_decode_layers`): one token a row
        after a prompt, where the Triton decode runs from device state (`_device_decode`)."""
        return (self.fuse_decode and cache is not None and cache.length > 0 and x.shape[1] == 1
                and len(self.layers) > 0 and self._device_decode(x.device))

    def _graph_ready(self, device: torch.device) -> bool:
        """Whether a decode step on `device` may run from a CUDA graph: where the Triton decode runs from
        device state (`_device_decode`), and without the mixture of experts (its routing sizes its
        launches on the host)."""
        return self.decode_cuda_graph and not self.config.num_experts and self._device_decode(device)

    def _device_decode(self, device: torch.device) -> bool:
        """Whether a decode step on `device` runs from device state alone: on the GPU through the Triton
        kernels (the reference reads lengths on the host), outside autograd and autocast, the whole stack
        on one GPU (a model split by `device_map` moves tensors in its layers' hooks)."""
        return (device.type == "cuda" and self.config.kernel_impl != "reference"
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda")
                and self._on_one_device(device))

    def _on_one_device(self, device: torch.device) -> bool:
        """Whether the whole stack sits on `device` (a model split over GPUs by `device_map` runs eagerly)."""
        ends = (self.layers[0].attn.q_proj.weight, self.layers[-1].mlp_norm.weight, self.norm.weight)
        return all(p.device == device for p in ends) if len(self.layers) else True


class NSAForCausalLM(NSAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: NSAConfig):
        super().__init__(config)
        self.model = NSAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def attention_stats(self) -> dict:
        return self.model.attention_stats()

    def reset_attention_stats(self) -> None:
        self.model.reset_attention_stats()

    def attention_stats_paused(self):
        """Context manager: forward passes inside it are not counted."""
        return self.model.attention_stats_paused()

    def recording_selections(self):
        """Context manager: each layer's selected blocks of every prefill inside it
        (`NSAModel.recording_selections`)."""
        return self.model.recording_selections()

    def capturing_selection_inputs(self):
        """Context manager: each layer's selection inputs of every prefill inside it
        (`NSAModel.capturing_selection_inputs`)."""
        return self.model.capturing_selection_inputs()

    @torch.no_grad()
    def warm_up_decode(self, batch_sizes: tuple[int, ...] = (1,), max_length: int | None = None) -> None:
        """Compile the Triton decode for every cache capacity up to `max_length` tokens (default: the
        model's context) at each batch size, so no generation stops to compile (a CUDA model only).

        The decode's launch constants follow the cache's capacity (`cache_nsa.CAPACITY_STEP` apart), so
        one call of the kernels on zero buffers of each capacity compiles all that decode will need; the
        fused step's other kernels (`NSAModel._decode_layers`) take one decode step at each batch size.
        """
        param = next(self.parameters())
        if not param.is_cuda or self.config.kernel_impl == "reference":
            return
        c = self.config
        max_length = max_length or c.max_position_embeddings
        kwargs = self.model.layers[0].attn.kernel_kwargs() if len(self.model.layers) else c.nsa_kwargs()
        per_block = self.model.layers[0].attn.counts_selected_blocks if len(self.model.layers) else False
        for B in batch_sizes:
            q = param.new_zeros(B, 1, c.num_attention_heads, c.head_dim)
            gate = param.new_zeros(B, 1, c.num_attention_heads)
            window = {}  # the ring of the window's own keys/values, as the cache holds it
            if not c.shared_kv and c.window > 0:
                window = dict(k_swa=param.new_zeros(B, c.window, c.num_key_value_heads, c.head_dim),
                              v_swa=param.new_zeros(B, c.window, c.num_key_value_heads, c.v_head_dim))
            for capacity in range(CAPACITY_STEP, round_capacity(max_length) + 1, CAPACITY_STEP):
                try:
                    k = param.new_zeros(B, capacity, c.num_key_value_heads, c.head_dim)
                    v = param.new_zeros(B, capacity, c.num_key_value_heads, c.v_head_dim)
                    rows = num_compressed(capacity, c.block_len, c.stride)  # the cache's, and its spare row
                    k_cmp = k.new_zeros(B, rows + 1, *k.shape[2:])
                    v_cmp = v.new_zeros(B, rows + 1, *v.shape[2:])
                    lens = torch.full((B,), capacity, dtype=torch.int32, device=param.device)
                    nsa_decode(q, k, v, k_cmp[:, :rows], v_cmp[:, :rows], gate, gate, gate,
                               cache_seqlens=lens, return_block_indices=per_block, **window, **kwargs)
                except torch.OutOfMemoryError:  # a cache this large would not fit either
                    warnings.warn(f"warm_up_decode: batch {B} stops at {capacity - CAPACITY_STEP} "
                                  "tokens (the GPU is out of memory); longer generations compile when they "
                                  "get there", stacklevel=2)
                    break
                finally:
                    k = v = k_cmp = v_cmp = None
            if self.model.fuse_decode:  # the fused step's own launches after a throwaway prompt: the step
                with self.attention_stats_paused():  # that completes the second block, then one that does not
                    prompt = c.block_len + c.stride - 1
                    ids = torch.zeros(B, prompt + 2, dtype=torch.long, device=param.device)
                    cache = getattr(self(ids[:, :prompt], use_cache=True), CACHE_FIELD)
                    for t in (prompt, prompt + 1):
                        self(ids[:, t : t + 1], cache=cache)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,  # ignored: positions follow the cache length
        cache: NSACache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: NSACache | None = None,  # the name transformers < 5.24 uses
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids `[B, T]` -> logits `[B, T, V]` (the last `logits_to_keep` positions if > 0)."""
        cache = cache if cache is not None else past_key_values
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache)
        hidden = out.last_hidden_state  # [B, T, C]
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # [B, T, V]
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].flatten(0, 1).float()  # [B * (T - 1), V]
            loss = F.cross_entropy(shifted, labels[:, 1:].flatten(), ignore_index=-100)
            aux = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
            if aux and self.config.router_aux_loss_coef:
                loss = loss + self.config.router_aux_loss_coef * torch.stack(aux).mean()
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})


AutoModel.register(NSAConfig, NSAModel, exist_ok=True)
AutoModelForCausalLM.register(NSAConfig, NSAForCausalLM, exist_ok=True)

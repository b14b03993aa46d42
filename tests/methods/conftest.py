"""Tiny random Llama models and a stand-in attention module for the methods' tests.

On a machine without a GPU the Triton prefill kernels run in Triton's interpreter: TRITON_INTERPRET=1 is
set here, before any test module imports triton, as tests/kernels/conftest.py does for the NSA kernels.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SPARSE_METHODS = ["sink_window", "topk", "quest", "h2o"]
ALL_METHODS = ["full", *SPARSE_METHODS]


def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 64, seed: int = 0):
    """A random LlamaForCausalLM (hidden 64, GQA 4:2), scaled up so attention is far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than the 0.02 init, so selections differ between methods
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(autouse=True, scope="module")
def one_thread(one_torch_thread):
    """Every methods test runs on one torch thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def fake_module(layer_idx: int = 0, groups: int = 2):
    """What the attention function needs of an attention module."""
    return types.SimpleNamespace(layer_idx=layer_idx, num_key_value_groups=groups, is_causal=True)


def random_qkv(B=2, Hq=4, Hkv=2, T=64, D=8, seed=0):
    """q `[B, Hq, T, D]`, k, v `[B, Hkv, T, D]` with sharp scores."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g) * 2
    k = torch.randn(B, Hkv, T, D, generator=g) * 2
    v = torch.randn(B, Hkv, T, D, generator=g)
    return q, k, v


def run_attend(method, q, k, v, mask=None, budget=32, sink=4, local=8, **params):
    """Run one layer call of `method` on raw tensors; returns (out `[B, T, Hq, D]`, keep `[B, Hq, T, S]`)."""
    from nsa_eval.methods import METHODS
    from nsa_eval.methods.base import BudgetConfig
    from nsa_eval.methods.controller import AttentionController

    instance = METHODS.get(method)(**params)
    controller = AttentionController(instance, BudgetConfig(budget, sink, local))
    controller.capture = []
    out = controller.attend(fake_module(groups=q.shape[1] // k.shape[1]), q, k, v, mask, None)
    keep = torch.cat([c[3] for c in controller.capture], dim=2)
    return out, keep

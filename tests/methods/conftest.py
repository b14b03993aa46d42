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


def one_hot(value):
    """Values `[B, Hkv, S, S]` in which key j carries the j-th unit vector, for `value` `[B, Hkv, S, Dv]`: a
    layer call's output is then each query's attention weights, and the keys it attended are those of
    weight above zero (`attended`; a kept key's weight is far from underflowing on these inputs)."""
    B, Hkv, S, _ = value.shape
    return torch.eye(S, dtype=value.dtype, device=value.device).expand(B, Hkv, S, S)


def attended(weights):
    """A layer call's output `[B, T, Hq, S]` on `one_hot` values -> the keys each query attended
    `[B, Hq, T, S]` bool."""
    return weights.transpose(1, 2) > 0


def prefill_by(method, kernels: bool):
    """`method` (an instance) with its fast prefill fixed: its Triton kernels on any device (True: on CPU
    tensors, Triton's interpreter) or never (False: the controller's chunked path, the reference)."""
    method.fast_prefill = method.triton_prefill if kernels else (lambda call: None)
    return method


def layer_call(method, q, k, v, mask=None, budget=32, sink=4, local=8, **params):
    """One layer call of `method` (a name) on raw tensors through the chunked path (its fast prefill off):
    (out `[B, T, Hq, Dv]`, keep `[B, Hq, T, S]`, the controller), keep from the same call on `one_hot`
    values by a second controller (H2O's state starts afresh)."""
    from nsa_eval.methods import METHODS
    from nsa_eval.methods.base import BudgetConfig
    from nsa_eval.methods.controller import AttentionController

    module = fake_module(groups=q.shape[1] // k.shape[1])
    controller, observer = (
        AttentionController(prefill_by(METHODS.get(method)(**params), kernels=False),
                            BudgetConfig(budget, sink, local)) for _ in range(2))
    out = controller.attend(module, q, k, v, mask, None)
    return out, attended(observer.attend(module, q, k, one_hot(v), mask, None)), controller


def run_attend(method, q, k, v, mask=None, budget=32, sink=4, local=8, **params):
    """Run one layer call of `method` on raw tensors; returns (out `[B, T, Hq, D]`, keep `[B, Hq, T, S]`)."""
    return layer_call(method, q, k, v, mask, budget, sink, local, **params)[:2]


def prefill_then_decode(model, ids, prompt: int):
    """The first `prompt` tokens of `ids` `[1, T]` as one prefill, then one decode step per later token:
    (logits `[1, T, V]`, the model's attention statistics)."""
    import torch

    from nsa_eval.methods import attention_stats

    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        logits = [out.logits]
        for t in range(prompt, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=out.past_key_values, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, 1), attention_stats(model)

"""NSAForCausalLM: save/reload, prefill == step-by-step decode, generate, stats, config checks."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.models import cache_nsa
from nsa_eval.models.cache_nsa import NSACache, num_compressed
from nsa_eval.models.modeling_nsa import (
    CACHE_FIELD,
    LayerShared,
    NSAForCausalLM,
    activated_tokens,
    selected_tokens,
)
from tests.models.conftest import tiny_nsa_config

LAYOUTS = {
    "paper": {},  # MLP compression, separate K/V per branch, window 8
    "fla": dict(compression="mean", shared_kv=True, block_len=4, stride=4, select_size=4, num_selected=4),
    "no_window_gate_mlp": dict(window=0, gate_hidden_size=16),
    "moe": dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=16,
                first_dense_layers=1),
    "mqa_dk_ne_dv": dict(num_key_value_heads=1, head_dim=12, v_head_dim=6),
    "compress_norm": dict(compress_norm=True),
}


def build(layout: str, seed: int = 0) -> NSAForCausalLM:
    torch.manual_seed(seed)
    return NSAForCausalLM(tiny_nsa_config(**LAYOUTS[layout])).eval()


def step_by_step_logits(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill `prompt_len` tokens, then decode the rest one token at a time through the cache."""
    out = model(ids[:, :prompt_len], use_cache=True)
    cache, logits = getattr(out, CACHE_FIELD), [out.logits]
    assert isinstance(cache, NSACache)
    for t in range(prompt_len, ids.shape[1]):
        out = model(ids[:, t : t + 1], cache=cache)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)  # [B, T, V]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefill_equals_step_by_step_decode(layout):
    model = build(layout)
    ids = torch.randint(0, 97, (2, 37))  # 37: crosses several compression and selection blocks
    with torch.no_grad():
        full = model(ids, use_cache=False).logits  # [B, T, V]
        for prompt_len in (3, 13):
            inc = step_by_step_logits(model, ids, prompt_len)
            torch.testing.assert_close(inc, full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_kernels_take_prompts_shorter_than_a_compression_block(layout):
    """A prompt of fewer than block_len tokens has no compressed key: through the Triton kernels (here in
    Triton's interpreter, where TMA descriptors are built as on sm_90) its logits are the reference's."""
    model = build(layout)
    ids = torch.randint(0, 97, (2, model.config.block_len - 1))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        model.config.kernel_impl = "triton"
        for T in (1, ids.shape[1]):
            torch.testing.assert_close(model(ids[:, :T], use_cache=False).logits, reference[:, :T],
                                       atol=2e-5, rtol=1e-4)


def test_a_forward_computes_its_rotary_tables_once_for_every_layer():
    """A prefill and a decode step compute cos/sin once for the tokens and once for the compressed blocks,
    whatever the number of layers (on the GPU each is a handful of kernels a step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCos(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountCos.calls += func is torch.ops.aten.cos.default
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, 97, (1, 21))
    for layers in (1, 3):
        torch.manual_seed(0)
        model = NSAForCausalLM(tiny_nsa_config(num_hidden_layers=layers)).eval()
        with torch.no_grad():
            CountCos.calls = 0
            with CountCos():
                cache = getattr(model(ids[:, :20], use_cache=True), CACHE_FIELD)
            assert CountCos.calls == 2, layers  # the tokens', the compressed blocks'
            CountCos.calls = 0
            with CountCos():
                model(ids[:, 20:], cache=cache)
            assert CountCos.calls == 2, layers
    shared = LayerShared()
    model.model.layers[0].attn.project(torch.randn(1, 3, 32), torch.arange(3), shared)
    assert ("rope", torch.float32) in shared  # an empty memo is filled, not replaced by a new one


def test_cache_holds_what_prefill_computes():
    model = build("paper")
    ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        whole = getattr(model(ids, use_cache=True), CACHE_FIELD)
        stepped = getattr(model(ids[:, :5], use_cache=True), CACHE_FIELD)
        for t in range(5, 30):
            model(ids[:, t : t + 1], cache=stepped)
    assert whole.length == stepped.length == 30 and whole.num_cmp == num_compressed(30, 8, 4) == 6
    for a, b in zip(whole.layers, stepped.layers, strict=True):
        for name in ("k_cmp", "v_cmp"):
            torch.testing.assert_close(getattr(a, name)[:, :6], getattr(b, name)[:, :6], atol=1e-5, rtol=1e-4)
        for name in ("k", "v", "k_cmp_in", "v_cmp_in"):
            x, y = getattr(a, name)[:, :30], getattr(b, name)[:, :30]
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
        assert not a.k[:, 30:].any()  # rows past the length stay zero


@pytest.mark.parametrize("layout", ["paper", "fla"])
def test_decode_across_cache_growth(layout, monkeypatch):
    """A cache of 8-token capacity steps grows four times while decoding; logits stay prefill's."""
    monkeypatch.setattr(cache_nsa, "CAPACITY_STEP", 8)
    model = build(layout)
    ids = torch.randint(0, 97, (2, 41))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits  # [B, T, V]
        out = model(ids[:, :9], use_cache=True)
        cache, logits = getattr(out, CACHE_FIELD), [out.logits]
        assert cache.capacity == 16
        for t in range(9, 41):
            logits.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert cache.capacity == 48 and cache.length == 41 and int(cache.position) == 41
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=2e-5, rtol=1e-4)


def test_save_reload_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build("moe")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is NSAForCausalLM and reloaded.config.model_type == "nsa_eval"
    ids = torch.randint(0, 97, (2, 21))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_compress_norm_bounds_the_compressed_keys_and_survives_a_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    plain, normed = build("paper"), build("compress_norm")
    # off by default: the checkpoints saved before the option load as they did
    assert not any("k_cmp_norm" in name for name, _ in plain.named_parameters())
    attn = normed.model.layers[0].attn
    with torch.no_grad():
        for module in (plain.model.layers[0].attn, attn):
            module.compress_k.fc2.weight.mul_(1000.0)  # what a long run did to nsa-long's compressor
        k_in = torch.randn(1, 40, attn.Hkv, attn.Dk)
        wild, _ = plain.model.layers[0].attn.compress(k_in, k_in, 0)
        bounded, _ = attn.compress(k_in, k_in, 0)
    rms = bounded.pow(2).mean(-1).sqrt()  # RoPE keeps each pair's norm, so the RMSNorm's 1 stays
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)
    assert wild.pow(2).mean(-1).sqrt().min() > 5 * rms.max()
    normed.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.compress_norm and reloaded.model.layers[0].attn.k_cmp_norm is not None
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        assert torch.equal(normed(ids).logits, reloaded(ids).logits)


def test_recording_selections_keeps_each_layers_blocks_and_changes_nothing():
    model = build("paper")
    cfg = model.config
    ids = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        plain = model(ids).logits
        with model.recording_selections() as recorded:
            logits = model(ids).logits
        after = model(ids).logits
    assert torch.equal(plain, logits) and torch.equal(plain, after)
    assert len(recorded) == cfg.num_hidden_layers and all(len(layer) == 1 for layer in recorded)
    blocks = recorded[0][0]
    assert blocks.shape == (2, 40, cfg.num_key_value_heads, cfg.num_selected)
    t = torch.arange(40)
    own = (t // cfg.select_size)[None, :, None]
    assert ((blocks == own[..., None]).any(-1)).all()  # the query's own block is always selected
    assert (blocks <= own[..., None]).all()  # never a block past the query
    assert all(layer.attn.recorded_blocks is None for layer in model.model.layers)  # off again


def test_greedy_generate_matches_argmax_loop():
    model = build("paper")
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=9, do_sample=False)
        seq = ids
        for _ in range(9):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert generated.shape == (1, 20)
    assert torch.equal(generated, seq)


def test_training_step_reaches_every_branch():
    model = build("paper").train()
    ids = torch.randint(0, 97, (2, 24))
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    attn = model.model.layers[0].attn
    for name in ("q_proj", "k_proj", "k_cmp_proj", "v_cmp_proj", "k_swa_proj", "g_proj", "o_proj"):
        grad = getattr(attn, name).weight.grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert attn.compress_k.pos_emb.grad.abs().sum() > 0 and attn.compress_k.fc1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("layout", ["paper", "fla"])
def test_bf16_autocast_forward_backward_and_decode(layout):
    """Under autocast the residual stream stays fp32 while projections give bf16: the layer must still
    hand the kernels one dtype (it used to pass fp32 q/k from RoPE beside a bf16 v, and fail)."""
    model = build(layout)
    ids = torch.randint(0, 97, (2, 37))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits  # [B, T, V], fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids, use_cache=False)
    assert out.logits.dtype == torch.bfloat16
    # bf16 rounding, and with 4-token blocks the odd top-n selection flip on near-tied block scores
    torch.testing.assert_close(out.logits.float(), reference, atol=5e-2, rtol=5e-2)
    assert (out.logits.float() - reference).abs().mean() < 1e-2
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.model.layers[0].attn.q_proj.weight.grad.abs().sum() > 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(ids, use_cache=False).logits
        stepped = step_by_step_logits(model, ids, 29)  # 8 steps of nsa_decode (bf16 on CPU is slow)
    torch.testing.assert_close(stepped.float(), full.float(), atol=5e-2, rtol=5e-2)


def test_moe_aux_loss_and_routing():
    model = build("moe")
    model.config.router_aux_loss_coef = 0.01
    ids = torch.randint(0, 97, (2, 16))
    out = model(ids, labels=ids, use_cache=False)
    moe = model.model.layers[1].mlp
    assert type(model.model.layers[0].mlp).__name__ == "SwiGLU"  # first_dense_layers=1
    assert moe.aux_loss is not None and moe.aux_loss > 0
    plain = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert out.loss > plain  # the balance loss is added


def test_padded_batch_is_refused():
    model = build("paper")
    ids = torch.randint(0, 97, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with pytest.raises(ValueError, match="padded"):
        model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="padded"):
        model(ids, attention_mask=mask, use_cache=False)
    right = torch.ones_like(ids)
    right[0, 5:] = 0
    with pytest.raises(ValueError, match="padded"):  # right padding would enter the cache
        model(ids, attention_mask=right, use_cache=True)


@pytest.mark.parametrize("num_init, num_local", [(1, 2), (0, 0)])
def test_right_padding_without_cache_is_not_counted(num_init, num_local):
    """Scoring a right-padded batch (lm-eval's loglikelihood): real positions' logits as unpadded,
    and the statistics equal those of the rows run one by one at their real lengths."""
    torch.manual_seed(0)
    model = NSAForCausalLM(tiny_nsa_config(num_init=num_init, num_local=num_local)).eval()
    ids = torch.randint(0, 97, (3, 30))
    lengths = [30, 17, 5]
    mask = (torch.arange(30)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        model.reset_attention_stats()
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        batched = model.attention_stats()
        model.reset_attention_stats()
        rows = [model(ids[i : i + 1, :n], use_cache=False).logits for i, n in enumerate(lengths)]
        separate = model.attention_stats()
    for i, n in enumerate(lengths):
        torch.testing.assert_close(padded[i, :n], rows[i][0], rtol=1e-5, atol=1e-5)
    assert batched["queries"] == sum(lengths) * 4 * 2  # tokens * heads * layers
    for key in ("queries", "max"):
        assert batched[key] == separate[key]
    assert batched["mean"] == pytest.approx(separate["mean"])
    assert batched["mean_per_branch"] == pytest.approx(separate["mean_per_branch"])


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(num_attention_heads=4, num_key_value_heads=3), "multiple of"),
        (dict(compression="max"), "compression"),
        (dict(block_len=8, stride=3), "divide"),
        (dict(num_selected=2, num_init=1, num_local=2), "num_init"),
        (dict(window=-1), "window"),
    ],
)
def test_config_rejects_inconsistent_fields(override, message):
    with pytest.raises(ValueError, match=message):
        tiny_nsa_config(**override)


@pytest.mark.parametrize("num_init, num_local", [(1, 2), (1, 1), (0, 0), (1, 0), (0, 2)])
def test_activated_tokens_match_the_kernel_selection(num_init, num_local):
    """The statistic counts exactly the tokens the kernel's selection and window branches use.

    With num_local >= 1 the formula is exact. With num_local = 0 the query's own partial block
    competes on score once it has more than n blocks, so the formula is exact only up to n blocks
    and an upper bound after; `selected_tokens`, which the model uses then, counts the kernel's blocks.
    """
    from nsa_eval.kernels import select_blocks

    torch.manual_seed(0)
    config = tiny_nsa_config(num_init=num_init, num_local=num_local)
    T, l, d, ls, n = 70, config.block_len, config.stride, config.select_size, config.num_selected
    q = torch.randn(1, T, 4, 8)
    k_cmp = torch.randn(1, num_compressed(T, l, d), 2, 8)
    blocks = select_blocks(q, k_cmp, block_len=l, stride=d, select_size=ls, num_selected=n,
                           num_init=config.num_init, num_local=config.num_local, impl="reference")
    t = torch.arange(T)
    counts = activated_tokens(t, config)
    starts = blocks[0].long() * ls  # [T, Hkv, n]
    valid = blocks[0] >= 0
    tokens = (torch.clamp(t[:, None, None] - starts + 1, min=0, max=ls) * valid).sum(-1)  # [T, Hkv]
    assert torch.equal(selected_tokens(t, blocks, ls)[0], tokens)
    if num_local >= 1:
        assert torch.equal(counts["selected"], tokens[:, 0]) and torch.equal(counts["selected"], tokens[:, 1])
    else:
        few = t // ls + 1 <= n  # at most n blocks: all selected, the own block included
        assert torch.equal(counts["selected"][few], tokens[few, 0])
        assert torch.equal(counts["selected"][few], t[few] + 1)
        assert bool((counts["selected"][~few, None] >= tokens[~few]).all())
        own_picked = (blocks[0] == (t // ls)[:, None, None]).any(-1)  # [T, Hkv]
        assert bool(own_picked[~few].any()) and not bool(own_picked[~few].all())  # both cases occur
    assert torch.equal(counts["compressed"], torch.tensor([num_compressed(i + 1, l, d) for i in range(T)]))
    assert torch.equal(counts["window"], torch.clamp(t + 1, max=config.window))


def test_model_counts_the_selected_blocks_when_num_local_is_0():
    """num_local = 0: the model's statistic is the tokens of the blocks its kernel selected, per layer
    and KV head (recomputed here from each layer's input), in prefill and in token-by-token decode."""
    from nsa_eval.kernels import select_blocks

    torch.manual_seed(0)
    config = tiny_nsa_config(num_init=0, num_local=0)
    model = NSAForCausalLM(config).eval()
    with torch.no_grad():  # sharp compressed attention: the own partial block then sometimes wins
        for layer in model.model.layers:
            layer.attn.q_proj.weight.mul_(100)
            layer.attn.compress_k.fc2.weight.mul_(100)
    T, ls = 40, config.select_size
    ids = torch.randint(0, 97, (2, T))
    inputs = []
    hooks = [layer.attn.register_forward_pre_hook(lambda mod, args: inputs.append((mod, args[0])))
             for layer in model.model.layers]
    with torch.no_grad():
        model.reset_attention_stats()
        model(ids, use_cache=False)
        prefill = model.attention_stats()
        for h in hooks:
            h.remove()
        expected = 0
        for attn, x in inputs:  # one per layer
            p = attn.project(x, torch.arange(T))
            k_cmp, _ = attn.compress(p["k_cmp_in"], p["v_cmp_in"], 0)
            kwargs = {k: v for k, v in attn.kernel_kwargs().items() if k not in ("window", "impl")}
            blocks = select_blocks(p["q"], k_cmp.to(p["q"].dtype), **kwargs, impl="reference")
            heads_per_kv_head = 4 // 2
            expected += int(selected_tokens(torch.arange(T), blocks, ls).sum()) * heads_per_kv_head
        model.reset_attention_stats()
        step_by_step_logits(model, ids, 1)
        decode = model.attention_stats()
    queries = 2 * T * 4 * 2  # batch * tokens * heads * layers
    assert prefill["queries"] == queries
    assert prefill["mean_per_branch"]["selected"] == pytest.approx(expected / queries)
    formula = activated_tokens(torch.arange(T), config)["selected"].float().mean()
    assert prefill["mean_per_branch"]["selected"] < formula  # the own block won somewhere (formula: bound)
    assert decode["queries"] == queries
    for key in ("mean", "max"):
        assert decode[key] == pytest.approx(prefill[key])


def test_attention_stats_paper_budget_at_32k():
    """The paper's matched budget: NSA's mean over a 32k sequence is about 2,560 tokens per query."""
    config = tiny_nsa_config(block_len=32, stride=16, select_size=64, num_selected=16, window=512)
    counts = activated_tokens(torch.arange(32768), config)
    assert 2500 < counts["total"].float().mean() < 2600
    assert counts["total"][-1] == 2047 + 1024 + 512  # Table 4 at 32k: 3584 token loads (rounded)


def test_model_records_attention_stats():
    model = build("paper")
    model.reset_attention_stats()
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 10)), use_cache=False)
    stats = model.attention_stats()
    expected = activated_tokens(torch.arange(10), model.config)["total"].float().mean()
    assert stats["queries"] == 2 * 10 * 4 * 2  # batch * tokens * heads * layers
    assert stats["mean"] == pytest.approx(float(expected))
    assert stats["phases"]["prefill"]["queries"] == stats["queries"] and stats["method"] == "nsa"

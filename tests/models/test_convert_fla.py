"""fla NSA checkpoints -> NSAForCausalLM, checked against an independent forward pass written here.

`fla_forward` follows fla's code (fla/models/nsa, fla/layers/nsa.py, fla/ops/nsa/naive.py) over a
state dict in fla's parameter names, without fla installed: RMSNorm, rotate-half RoPE on q and k,
mean pooling of rotated keys over non-overlapping blocks, compressed attention over complete blocks,
top-n blocks by the group-mean compression probability with the first, current and previous block
forced, selected attention, a window of `window_size` keys, sigmoid gates (h, 3), GatedMLP.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nsa_eval.errors import UsageError
from nsa_eval.models.convert_fla import convert_fla_state_dict, load_fla_model, nsa_config_from_fla
from nsa_eval.models.modeling_nsa import NSAForCausalLM

FLA_CONFIG = dict(model_type="nsa", hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, block_size=4, block_counts=4, window_size=6, rope_theta=10000.0,
                  max_position_embeddings=256, hidden_ratio=4, intermediate_size=48, norm_eps=1e-6,
                  vocab_size=61, tie_word_embeddings=False, fuse_norm=True, fuse_swiglu=True)


def random_fla_state(cfg: dict, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    C, H, Hkv, D, inter = (cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"],
                           cfg["intermediate_size"])

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    state = {"model.embeddings.weight": w(cfg["vocab_size"], C), "model.norm.weight": 1 + w(C),
             "lm_head.weight": w(cfg["vocab_size"], C)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {p + "attn_norm.weight": 1 + w(C), p + "mlp_norm.weight": 1 + w(C),
                  p + "attn.q_proj.weight": w(H * D, C), p + "attn.k_proj.weight": w(Hkv * D, C),
                  p + "attn.v_proj.weight": w(Hkv * D, C), p + "attn.g_proj.weight": w(3 * H, C),
                  p + "attn.o_proj.weight": w(C, H * D), p + "mlp.gate_proj.weight": w(inter, C),
                  p + "mlp.up_proj.weight": w(inter, C), p + "mlp.down_proj.weight": w(C, inter)}
    return state


def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, theta):  # x [B, T, H, D], rotate-half layout
    T, D = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(T).float()[:, None] * inv  # [T, D/2]
    cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def fla_nsa(q, k, v, g_cmp, g_slc, g_swa, bs, S, window):
    """fla's naive NSA for one sequence batch, dense masks, no kernels. q [B,T,H,D], k/v [B,T,Hkv,D]."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k, v = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)  # [B, T, H, D]
    scale = D ** -0.5
    nb = (T + bs - 1) // bs
    pad = nb * bs - T
    k_cmp = F.pad(k, (0, 0, 0, 0, 0, pad)).view(B, nb, bs, H, D).sum(2) / torch.tensor(
        [min(bs, T - c * bs) for c in range(nb)]).view(1, nb, 1, 1)  # mean pooling, last block partial
    v_cmp = F.pad(v, (0, 0, 0, 0, 0, pad)).view(B, nb, bs, H, D).sum(2) / torch.tensor(
        [min(bs, T - c * bs) for c in range(nb)]).view(1, nb, 1, 1)
    t = torch.arange(T)[:, None]
    c = torch.arange(nb)[None, :]
    visible = (c + 1) * bs - 1 <= t  # [T, nb]
    s_cmp = torch.einsum("bthd,bchd->bhtc", q, k_cmp) * scale
    s_cmp = s_cmp.masked_fill(~visible, float("-inf"))
    p_cmp = torch.nan_to_num(s_cmp.softmax(-1), nan=0.0)  # [B, H, T, nb]
    o_cmp = torch.einsum("bhtc,bchd->bthd", p_cmp, v_cmp)
    # top-k per (token, KV head): group-mean probability, forced first / current / previous block
    scores = p_cmp.view(B, H // G, G, T, nb).mean(2)  # [B, Hkv, T, nb]
    blk = t // bs
    forced = (c == 0) | (c == blk) | (c == blk - 1)
    scores = torch.where(forced, torch.ones_like(scores), scores)
    top = scores.topk(min(S, nb), dim=-1).indices  # [B, Hkv, T, S]
    allowed = (visible | forced)[None, None].expand(B, H // G, T, nb)
    keep = torch.zeros_like(allowed).scatter(-1, top, True) & allowed  # [B, Hkv, T, nb]
    token_keep = keep.repeat_interleave(bs, -1)[..., :T].repeat_interleave(G, 1)  # [B, H, T, T]
    causal = torch.arange(T)[None, :] <= t
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    p_slc = s.masked_fill(~(token_keep & causal), float("-inf")).softmax(-1)  # [B, H, T, T]
    o_slc = torch.einsum("bhts,bshd->bthd", p_slc, v)
    o = o_slc * g_slc[..., None] + o_cmp * g_cmp[..., None]
    if window > 0:
        in_window = causal & (torch.arange(T)[None, :] > t - window)
        o_swa = torch.einsum("bhts,bshd->bthd", s.masked_fill(~in_window, float("-inf")).softmax(-1), v)
        o = o + o_swa * g_swa[..., None]
    return o


def fla_forward(state: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    H, Hkv, D, eps = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["norm_eps"]
    B, T = ids.shape
    x = state["model.embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, state[p + "attn_norm.weight"], eps)
        q = rope((h @ state[p + "attn.q_proj.weight"].T).view(B, T, H, D), cfg["rope_theta"])
        k = rope((h @ state[p + "attn.k_proj.weight"].T).view(B, T, Hkv, D), cfg["rope_theta"])
        v = (h @ state[p + "attn.v_proj.weight"].T).view(B, T, Hkv, D)
        g = (h @ state[p + "attn.g_proj.weight"].T).view(B, T, H, 3).sigmoid()
        o = fla_nsa(q, k, v, g[..., 0], g[..., 1], g[..., 2], cfg["block_size"], cfg["block_counts"],
                    cfg["window_size"])
        x = x + o.reshape(B, T, H * D) @ state[p + "attn.o_proj.weight"].T
        h = rms(x, state[p + "mlp_norm.weight"], eps)
        gate, up = h @ state[p + "mlp.gate_proj.weight"].T, h @ state[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    return rms(x, state["model.norm.weight"], eps) @ state["lm_head.weight"].T


@pytest.mark.parametrize("window_size", [6, 0])
def test_converted_model_matches_fla_forward(window_size):
    cfg = dict(FLA_CONFIG, window_size=window_size)
    state = random_fla_state(cfg)
    model = NSAForCausalLM(nsa_config_from_fla(cfg)).eval()
    model.load_state_dict(convert_fla_state_dict(state, model), strict=True)
    ids = torch.randint(0, cfg["vocab_size"], (2, 30))  # 30 tokens: 8 blocks of 4, selection keeps 4
    with torch.no_grad():
        ref = fla_forward(state, cfg, ids)
        ours = model(ids, use_cache=False).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert model.config.compression == "mean" and model.config.shared_kv
    assert model.config.window == window_size


def test_convert_checkpoint_directory_and_load_by_path(tmp_path, tokenizer_dir):
    from nsa_eval.models.convert_fla import convert_fla_checkpoint
    from nsa_eval.models.loading import load_pretrained

    src = tmp_path / "fla"
    src.mkdir()
    cfg = dict(FLA_CONFIG, vocab_size=300)
    state = random_fla_state(cfg, seed=1)
    (src / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(src / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((tokenizer_dir / name).read_bytes())
    ids = torch.randint(0, 300, (1, 19))
    with torch.no_grad():
        ref = fla_forward(state, cfg, ids)
        direct, _ = load_pretrained(src)  # an fla directory converts in memory
        saved, _ = load_pretrained(convert_fla_checkpoint(src, tmp_path / "out"))
        torch.testing.assert_close(direct(ids, use_cache=False).logits, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(saved(ids, use_cache=False).logits, ref, atol=1e-4, rtol=1e-4)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "nsa_eval"


def test_mismatched_fla_state_is_refused(tmp_path):
    state = random_fla_state(FLA_CONFIG)
    model = NSAForCausalLM(nsa_config_from_fla(FLA_CONFIG))
    del state["model.layers.1.attn.g_proj.weight"]
    with pytest.raises(UsageError, match="missing"):
        convert_fla_state_dict(state, model)
    state = random_fla_state(FLA_CONFIG)
    state["lm_head.weight"] = state["lm_head.weight"][:, :5]
    with pytest.raises(UsageError, match="shape"):
        convert_fla_state_dict(state, model)
    with pytest.raises(UsageError, match="attnres"):
        nsa_config_from_fla(dict(FLA_CONFIG, attnres_block_size=2))
    (tmp_path / "config.json").write_text(json.dumps(FLA_CONFIG))
    with pytest.raises(UsageError, match="no \\*.safetensors"):
        load_fla_model(tmp_path)


# fla's NSAConfig defaults (fla/models/nsa/configuration_nsa.py lines 23-41 at fla 0.6.0 and at the model's
# first commit 7229f4ae), written out here rather than read from convert_fla so a drift shows. Every field
# below is given, with a value that is not fla's default, in FULL_FLA_CONFIG.
FULL_FLA_CONFIG = dict(model_type="nsa", hidden_size=512, num_hidden_layers=2, num_heads=8, num_kv_heads=2,
                       head_dim=16, qkv_bias=True, block_size=32, block_counts=8, window_size=128,
                       rope_theta=500000.0, max_position_embeddings=4096, hidden_ratio=2,
                       intermediate_size=1000, norm_eps=1e-5, vocab_size=61, tie_word_embeddings=True,
                       bos_token_id=5, eos_token_id=6, pad_token_id=7)
FLA_DEFAULT_CASES = [  # (fields left out of config.json, {NSAConfig attribute: what fla builds})
    (["num_kv_heads"], {"num_key_value_heads": 4}),  # not num_heads (8)
    (["window_size"], {"window": 512}),  # fla's window branch is on by default
    (["head_dim"], {"head_dim": 32}),  # not hidden_size // num_heads (64)
    (["qkv_bias"], {"attention_bias": False}),
    (["block_size"], {"block_len": 64, "stride": 64, "select_size": 64}),
    (["block_counts"], {"num_selected": 16}),
    (["rope_theta"], {"rope_theta": 10000.0}),
    (["norm_eps"], {"rms_norm_eps": 1e-6}),
    (["intermediate_size"], {"intermediate_size": 768}),  # int(512 * 2 * 2/3) = 682, up to 256s
    (["intermediate_size", "hidden_ratio"], {"intermediate_size": 1536}),  # hidden_ratio 4: 1365 -> 1536
    (["max_position_embeddings"], {"max_position_embeddings": 2048}),
    (["tie_word_embeddings"], {"tie_word_embeddings": False}),
    (["bos_token_id", "eos_token_id", "pad_token_id"], {"bos_token_id": 1, "eos_token_id": 2,
                                                        "pad_token_id": None}),
]


def write_fla_config(directory, cfg: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def config_from_file(directory):
    return nsa_config_from_fla(json.loads((directory / "config.json").read_text()))


@pytest.mark.parametrize("dropped, expected", FLA_DEFAULT_CASES, ids=lambda x: "+".join(x) if
                         isinstance(x, list) else None)
def test_missing_field_takes_fla_default(tmp_path, dropped, expected):
    cfg = {k: v for k, v in FULL_FLA_CONFIG.items() if k not in dropped}
    config = config_from_file(write_fla_config(tmp_path, cfg))
    assert {name: getattr(config, name) for name in expected} == expected
    given = config_from_file(write_fla_config(tmp_path / "full", FULL_FLA_CONFIG))  # the field is read
    assert {name: getattr(given, name) for name in expected} != expected


def test_null_fields_as_fla_reads_them(tmp_path):
    # fla/layers/nsa.py: num_kv_heads None -> num_heads; GatedMLP: hidden_ratio None -> 4
    config = config_from_file(write_fla_config(tmp_path, dict(FULL_FLA_CONFIG, num_kv_heads=None,
                                                              hidden_ratio=None, intermediate_size=None)))
    assert (config.num_key_value_heads, config.intermediate_size) == (8, 1536)
    config = config_from_file(write_fla_config(tmp_path, dict(FULL_FLA_CONFIG, window_size=0)))
    assert config.window == 0


def test_config_with_only_required_fields_loads_as_fla_builds_it(tmp_path):
    cfg = dict(model_type="nsa", hidden_size=32, num_hidden_layers=1, num_heads=8, vocab_size=61)
    full = dict(cfg, num_kv_heads=4, head_dim=32, block_size=64, block_counts=16, window_size=512,
                rope_theta=10000.0, norm_eps=1e-6, intermediate_size=256)  # fla's defaults, spelled out
    write_fla_config(tmp_path, cfg)
    state = random_fla_state(full, seed=2)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = load_fla_model(tmp_path)
    assert (model.config.num_key_value_heads, model.config.window, model.config.select_size) == (4, 512, 64)
    ids = torch.randint(0, 61, (1, 140))  # three blocks of 64, every key inside the 512-token window
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, fla_forward(state, full, ids),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("field, value, expected", [
    ("num_kv_heads", 3, "a divisor of num_heads (8)"),
    ("num_kv_heads", 0, "an integer >= 1 or null"),
    ("num_heads", 8.0, "an integer >= 1"),
    ("hidden_size", "512", "an integer >= 1"),
    ("num_hidden_layers", True, "an integer >= 1"),
    ("head_dim", None, "an even integer >= 2"),
    ("head_dim", 15, "an even integer >= 2"),
    ("block_size", 48, "a power of two >= 1"),
    ("block_size", None, "a power of two >= 1"),
    ("block_counts", 12, "a power of two >= 4"),
    ("block_counts", 2, "a power of two >= 4"),
    ("window_size", None, "an integer >= 0"),
    ("window_size", -1, "an integer >= 0"),
    ("window_size", 6.5, "an integer >= 0"),
    ("rope_theta", None, "a number > 0"),
    ("norm_eps", 0, "a number > 0"),
    ("hidden_ratio", -2, "a number > 0"),
    ("qkv_bias", "false", "true or false"),
    ("tie_word_embeddings", 1, "true or false"),
])
def test_invalid_fla_config_is_refused_naming_file_field_value(tmp_path, field, value, expected):
    write_fla_config(tmp_path, dict(FULL_FLA_CONFIG, **{field: value}))
    with pytest.raises(UsageError) as err:
        load_fla_model(tmp_path)  # refused before any weights are looked for
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: {field} is {value!r}, expected {expected}")
    assert "\n" not in message


def test_unusable_fla_config_file_is_refused(tmp_path):
    cfg = {k: v for k, v in FULL_FLA_CONFIG.items() if k != "hidden_size"}
    write_fla_config(tmp_path, cfg)
    with pytest.raises(UsageError, match=r"config\.json: hidden_size is missing, expected an integer"):
        load_fla_model(tmp_path)
    write_fla_config(tmp_path, dict(FULL_FLA_CONFIG, model_type="llama"))
    with pytest.raises(UsageError, match=r"config\.json: model_type is 'llama', expected 'nsa'"):
        load_fla_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match=r"config\.json: not readable as JSON"):
        load_fla_model(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(UsageError, match=r"config\.json: expected a JSON object, got list"):
        load_fla_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(UsageError, match="no config.json"):
        load_fla_model(tmp_path)

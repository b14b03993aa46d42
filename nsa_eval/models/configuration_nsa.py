"""`NSAConfig`: every hyperparameter of the NSA model, saved in `config.json`.

The NSA fields follow the paper's names (arXiv 2502.11089, Sec. 3.3 and 4.1): compression block `l`
(`block_len`) and stride `d` (`stride`), selection block `l'` (`select_size`), `n` selected blocks
(`num_selected`, counting `num_init` leading and `num_local` trailing forced blocks) and window `w`
(`window`). Two layouts live in one model through switches:

- the paper's: `compression="mlp"` (an MLP with intra-block position encoding), `shared_kv=False`
  (each branch has its own keys and values), l=32, d=16, l'=64;
- flash-linear-attention's (`convert_fla.py`): `compression="mean"`, `shared_kv=True`,
  l = d = l' = fla's `block_size`, and `window=0` when fla has no window branch.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

# Fields a saved NSA config.json must spell out; defaults would silently change the architecture.
REQUIRED_NSA_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "compression",
    "block_len",
    "stride",
    "select_size",
    "num_selected",
    "window",
    "shared_kv",
)

COMPRESSIONS = ("mlp", "mean")


class NSAConfig(PretrainedConfig):
    """Configuration of `NSAForCausalLM` (model_type `nsa_eval`, distinct from fla's `nsa`)."""

    model_type = "nsa_eval"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        intermediate_size: int = 2816,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 1,
        head_dim: int | None = None,  # None: hidden_size // num_attention_heads
        v_head_dim: int | None = None,  # None: head_dim (the paper's 27B model uses 192 / 128)
        hidden_act: str = "silu",
        max_position_embeddings: int = 8192,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        attention_bias: bool = False,
        # --- NSA ---
        compression: str = "mlp",  # "mlp" (paper) or "mean" (fla: parameter-free mean pooling)
        compress_hidden_size: int | None = None,  # hidden width of the compression MLP; None: 4 * head_dim
        block_len: int = 32,  # l: tokens per compressed block
        stride: int = 16,  # d: distance between compressed blocks (l - d tokens overlap)
        select_size: int = 64,  # l': tokens per selection block
        num_selected: int = 16,  # n: selected blocks per query, forced ones included
        num_init: int = 1,  # leading blocks always selected
        num_local: int = 2,  # trailing blocks always selected (the query's own block and the one before)
        window: int = 512,  # w: sliding window; 0 switches the window branch off (as fla's window_size=0)
        shared_kv: bool = False,  # False: separate keys/values per branch (paper); True: one set (fla)
        gate_hidden_size: int | None = None,  # None: one Linear (fla's g_proj); int: Linear-SiLU-Linear
        # True: an RMSNorm (learned scale) over each compressed key before its rotation, which bounds the
        # compression logits; without it they can grow until the softmax, and so the selection's
        # importance, is one block and exact zeros (not in the paper; docs/training.md)
        compress_norm: bool = False,
        kernel_impl: str = "auto",  # nsa_eval.kernels impl: "auto" (Triton on CUDA), "reference", "triton"
        # --- mixture of experts (DeepSeekMoE); num_experts=0 keeps a dense SwiGLU MLP ---
        num_experts: int = 0,  # routed experts
        num_experts_per_tok: int = 2,  # top-k routed experts per token
        num_shared_experts: int = 0,  # always-on experts
        moe_intermediate_size: int | None = None,  # width of each expert; None: intermediate_size
        first_dense_layers: int = 0,  # the first k layers keep a dense MLP (DeepSeek's first_k_dense_replace)
        norm_topk_prob: bool = True,  # renormalise the top-k router probabilities to sum to 1
        router_aux_loss_coef: float = 0.0,  # load-balancing loss weight (training only)
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.v_head_dim = v_head_dim if v_head_dim is not None else self.head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attention_bias = attention_bias
        self.compression = compression
        self.compress_hidden_size = compress_hidden_size if compress_hidden_size else 4 * self.head_dim
        self.block_len = block_len
        self.stride = stride
        self.select_size = select_size
        self.num_selected = num_selected
        self.num_init = num_init
        self.num_local = num_local
        self.window = window
        self.shared_kv = shared_kv
        self.gate_hidden_size = gate_hidden_size
        self.compress_norm = bool(compress_norm)
        self.kernel_impl = kernel_impl
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size if moe_intermediate_size else intermediate_size
        self.first_dense_layers = first_dense_layers
        self.norm_topk_prob = norm_topk_prob
        self.router_aux_loss_coef = router_aux_loss_coef
        self.use_cache = use_cache
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )
        self.validate_nsa()

    def validate_nsa(self) -> None:
        """Raise ValueError naming the field when the NSA hyperparameters cannot work together."""
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.compression not in COMPRESSIONS:
            problems.append(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        for name in ("block_len", "stride", "select_size", "num_selected"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_len % self.stride:
            problems.append(f"stride ({self.stride}) must divide block_len ({self.block_len})")
        if self.select_size % self.stride:
            problems.append(f"select_size ({self.select_size}) must be a multiple of stride ({self.stride})")
        if self.num_init < 0 or self.num_local < 0:
            problems.append("num_init and num_local must be >= 0")
        if self.num_init + self.num_local > self.num_selected:
            problems.append(
                f"num_init + num_local ({self.num_init} + {self.num_local}) must be <= "
                f"num_selected ({self.num_selected})"
            )
        if self.window < 0:
            problems.append(f"window must be >= 0 (0 = no window branch), got {self.window}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            problems.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"num_experts ({self.num_experts})"
            )
        if problems:
            raise ValueError("invalid NSAConfig: " + "; ".join(problems))

    def nsa_kwargs(self) -> dict:
        """The keyword arguments `nsa_eval.kernels.nsa_attention` / `nsa_decode` take from this config."""
        return dict(
            block_len=self.block_len,
            stride=self.stride,
            select_size=self.select_size,
            num_selected=self.num_selected,
            num_init=self.num_init,
            num_local=self.num_local,
            window=self.window,
            impl=self.kernel_impl,
        )


AutoConfig.register(NSAConfig.model_type, NSAConfig, exist_ok=True)

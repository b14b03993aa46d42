"""Harness benchmark: what a user waits for, a prompt through a whole model, for every attention method.

Every method runs on a random model of one shape (default: Llama-3.2-1B's), loaded from a checkpoint
folder the way `nsa-eval run` loads one, and each figure is one cell of the report's tables:
- prefill (batch 1): the model's forward over the prompt, filling its cache (the logits of the last
  position only, as generation needs), one warm-up call and then up to `repeats` timed calls;
- decode (each decode batch): from a cache filled once (batch 1 reuses the prefill's), the wall time
  per token of `repeats` rounds of `decode_tokens` steps; a step is the model's forward of one token
  with its cache and the next token's argmax, on the device. The first step (it may compile and
  capture) is timed alone. Beside it, the step's memory floor (floor.py) and the GPU time of one step
  from replays of its CUDA graph back to back (no host work between): nsa's graph and output head, the
  other methods' graph of the whole step from a static cache (`StaticDecodeCache`, which the prefill
  fills when the adapter decodes from one: on a GPU);
- generation throughput (full and nsa, when asked): tokens per second of lm-eval's own generation
  call with sampling (T = 0.7, top-p 0.95, as configs/paper.yaml's AIME entries), at batch 16;
- peak memory above the weights and the memory the cache holds after the prefill; Triton
  compilations during the timed decode (a compilation after warm-up stalls generation).

Each figure runs under a time cap: a figure past it stops (checked before every forward of the model
and of each decoder layer, and between timed calls) and is reported as "timeout"; a GPU out of memory
is reported as "OOM"; either way the table goes on with the next figure, and figures whose outcome
follows (a longer prompt of a method whose prefill ran past the cap, a batch that ran out of memory
at a shorter length) are "skipped". Rows are written as they finish (harness_store.py). The cap
starts after the figure's warm-up, which has its own, longer one (`warmup_cap_s`): a first call at a new
length compiles and autotunes the kernels on a fresh machine, a cost paid once that says nothing of the
method's speed.

This module holds what the harness measures with: its settings, the cap, the models and their steps;
harness_run.py runs the figures.

Rows: `transformers` (lm-eval's stock `hf` model on the same Llama checkpoint, no nsa-eval: the
adapter's own overhead shows against the `full` row), `full`, `sink_window`, `topk`, `quest`, `h2o`
(nsa-eval's attention methods on the Llama checkpoint at the given budget, every query held to it),
`h2o_dense` (h2o with `sparse_prefill: false`: the prompt attends densely, then the cache evicts, as
the reference H2O code does) and `nsa` (an NSA model of the same shape, the paper's block sizes).
Ratios are to `full` measured in the same run.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nsa_eval.budget import BudgetConfig

METHODS = ("transformers", "full", "sink_window", "topk", "quest", "h2o", "h2o_dense", "nsa")
THROUGHPUT_METHODS = ("full", "nsa")
# lm-eval's generate_until settings of configs/paper.yaml's AIME entries
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.95)
WARM_UP_STEPS = 2  # decode steps before the timed rounds: the first may compile and capture a graph
# The NSA checkpoint's stride (NSAConfig's default, the paper's): one decode step in NSA_STRIDE completes a
# compressed block, so that many consecutive steps capture both of NSA's graphs
NSA_STRIDE = 16
# what nsa's "GPU time per step" is: a settings key, so that figures timed otherwise are not mixed in
NSA_GPU_STEP = "both graphs, weighted by the stride"


@dataclass(frozen=True)
class ModelShape:
    """The size of the random models: a Llama and an NSA model with the same widths and heads."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0


SHAPES = {
    "llama-3.2-1b": ModelShape(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
                               vocab=128256),
    # a few layers of a few heads: the CPU test of the benchmark's machinery
    "tiny": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=8192),
}


@dataclass(frozen=True)
class HarnessConfig:
    """What one `nsa-eval bench harness` measures (the CLI's flags)."""

    shape: ModelShape
    lengths: tuple[int, ...]
    methods: tuple[str, ...] = METHODS
    decode_batches: tuple[int, ...] = (1, 16)
    decode_tokens: int = 16
    repeats: int = 3
    cap_s: float = 45.0  # 7 methods x 3 lengths x 3 figures fit 10 minutes when a few slow ones hit it
    # a figure's warm-up (its first prefill call; a decode figure's own prefill and warm-up steps) runs
    # under this instead: on a fresh machine it compiles and autotunes at each new length
    warmup_cap_s: float = 90.0
    budget: int = BudgetConfig.budget
    sink: int = BudgetConfig.sink
    local: int = BudgetConfig.local
    device: str = "cuda"
    dtype: str = "bfloat16"
    throughput_tokens: int = 0  # 0: no throughput row
    throughput_batch: int = 16
    throughput_prompt: int = 256
    throughput_cap_s: float = 540.0  # a 16k-token generation at batch 16 takes minutes, not seconds

    @property
    def warm_up_cap_s(self) -> float:
        """The warm-up's cap as it applies: `warmup_cap_s`, never shorter than the figure's own cap."""
        return max(self.warmup_cap_s, self.cap_s)

    def cap_of(self, kind: str) -> float:
        return self.throughput_cap_s if kind == "throughput" else self.cap_s

    def settings(self) -> dict:
        """What every figure depends on: a results folder holds figures of one such setting."""
        return {"shape": asdict(self.shape), "dtype": self.dtype, "budget": self.budget, "sink": self.sink,
                "local": self.local, "decode_tokens": self.decode_tokens, "repeats": self.repeats,
                "device": device_name(self.device), "nsa_gpu_step": NSA_GPU_STEP}

    @property
    def max_length(self) -> int:
        """Context the models are built for: the longest prompt and every step the harness takes after it
        (warm-up, timed rounds and nsa's graph replays), or the throughput's prompt and generation."""
        decode = max(self.lengths, default=0) + decode_room(self)
        return max(decode, self.throughput_prompt + self.throughput_tokens) + 8


def decode_room(config: HarnessConfig) -> int:
    """Tokens a decode figure writes past its prompt: the warm-up, the timed rounds, the steps that may
    still be needed to capture NSA's second graph and the graph replays (`graph_replay_ms`: one more than
    the timed steps a graph, and an NSA cache has two)."""
    steps = config.repeats * config.decode_tokens
    return WARM_UP_STEPS + steps + NSA_STRIDE + 2 * (steps + 1)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


# ---------------------------------------------------------------------------------------------------- cap


class FigureTimeout(Exception):
    """A figure ran past its cap. Not a RuntimeError: the NSA model catches those around its graph
    capture, and a timeout must reach the harness."""


@dataclass
class Deadline:
    """The cap of one figure: `check()` raises FigureTimeout once `seconds` have passed since start."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def check(self) -> None:
        if self.elapsed > self.seconds:
            raise FigureTimeout(f"past the {self.seconds:g} s cap")

    def restart(self, seconds: float) -> None:
        """A new cap of `seconds` from now: the timed part of a figure after its warm-up."""
        self.seconds, self.start = seconds, time.monotonic()


@contextlib.contextmanager
def watched(model, deadline: Deadline, finished: list[int] | None = None) -> Iterator[None]:
    """Check `deadline` before every forward of `model` and of each of its decoder layers (so a long
    prefill stops within a layer of the cap); count the model's finished forwards in `finished[0]`. No
    check while a CUDA graph is being captured (its replays run no Python; a capture must not be left
    half done)."""

    def check(module, args):
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            deadline.check()

    def count(module, args, output):
        if finished is not None:
            finished[0] += 1

    layers = [layer for name, module in model.named_modules()
              if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) for layer in module]
    handles = [model.register_forward_pre_hook(check), model.register_forward_hook(count)]
    handles += [layer.register_forward_pre_hook(check) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------- models


@contextlib.contextmanager
def counting_compilations() -> Iterator[list[int]]:
    """Count Triton kernels compiled inside the block (Triton's pre-compilation hook)."""
    count = [0]
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing can compile
        yield count
        return
    before = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        count[0] += 1
        return before(*args, **kwargs) if before is not None else False

    knobs.runtime.jit_cache_hook = hook
    try:
        yield count
    finally:
        knobs.runtime.jit_cache_hook = before


def write_checkpoint(kind: str, shape: ModelShape, folder: Path, max_length: int, dtype: torch.dtype,
                     device: str) -> Path:
    """A random checkpoint of `shape` ("llama" or "nsa") in `folder`/`kind`, with the bundled tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nsa_eval.models.configuration_nsa import NSAConfig
    from nsa_eval.models.loading import resolve_checkpoint
    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rope_theta=shape.rope_theta,
                  max_position_embeddings=max_length, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    config, cls = (LlamaConfig(**common), LlamaForCausalLM) if kind == "llama" else (NSAConfig(**common),
                                                                                       NSAForCausalLM)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype)
    path = folder / kind
    model.save_pretrained(path)
    del model
    tokenizer_dir = Path(resolve_checkpoint("nsa-tiny"))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, path / file)
    return path


def load_lm(method: str, checkpoint: Path, config: HarnessConfig):
    """The lm-eval model of one row: stock HFLM for `transformers`, nsa-eval's adapter otherwise."""
    from lm_eval.models.huggingface import HFLM

    from nsa_eval.methods import apply_attention
    from nsa_eval.models.lm_adapter import NSAEvalLM

    common = dict(dtype=config.dtype, device=config.device, max_length=config.max_length)
    if method == "transformers":
        return HFLM(pretrained=str(checkpoint), **common)
    if method == "nsa":
        return NSAEvalLM(str(checkpoint), attention="nsa", **common)
    lm = NSAEvalLM(str(checkpoint), attention="full", **common)
    dense = method == "h2o_dense"
    apply_attention(lm.model, "h2o" if dense else method, budget=config.budget, sink=config.sink,
                    local=config.local, sparse_prefill=not dense)
    return lm


# ---------------------------------------------------------------------------------------------- steps


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Let the GPU finish what a stopped figure queued, and give its memory back before the next one."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def random_prompt(batch: int, length: int, vocab: int, device: str) -> torch.Tensor:
    """Random token ids `[batch, length]`, the same for every method at one (batch, length)."""
    generator = torch.Generator().manual_seed(length * 1000 + batch)
    return torch.randint(3, min(vocab, 8192), (batch, length), generator=generator).to(device)


def prefill(model, ids: torch.Tensor, room: int = 0):
    """The prompt `ids` `[B, T]` through `model`: its filled cache and the next tokens `[B, 1]` (argmax of
    the last position's logits, the only ones computed). A model that decodes from a static cache gets one
    with `room` tokens past the prompt."""
    from nsa_eval.models.hf_decode_graph import static_cache_for
    from nsa_eval.models.modeling_nsa import CACHE_FIELD

    cache = static_cache_for(model, ids.shape[1] + room) if room else None
    out = model(ids, use_cache=True, logits_to_keep=1, **({CACHE_FIELD: cache} if cache is not None else {}))
    return getattr(out, CACHE_FIELD), out.logits[:, -1].argmax(-1, keepdim=True)


def decode_step(model, cache, token: torch.Tensor) -> torch.Tensor:
    """One generation step from `cache`: `token` `[B, 1]` in, the next tokens `[B, 1]` out (no host sync)."""
    from nsa_eval.models.modeling_nsa import CACHE_FIELD

    logits = model(token, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache}).logits  # [B, 1, V]
    return logits[:, -1].argmax(-1, keepdim=True)


def capture_both_graphs(model, cache, token: torch.Tensor) -> torch.Tensor:
    """Decode steps from `token` `[B, 1]` until an NSA cache that captured one of its graphs has both (the
    step that completes a compressed block and the one that does not: within `stride` steps); a cache
    without graphs, or of another model, takes none. Returns the next tokens."""
    for _ in range(getattr(cache, "stride", 0)):
        if len(getattr(cache, "decode_graphs", {})) != 1:
            break
        token = decode_step(model, cache, token)
    return token


def graph_replay_ms(model, cache, token: torch.Tensor, steps: int) -> float | None:
    """GPU ms of one decode step whose `cache` captured its decode graph: the graph (and, for an NSA model,
    the output head) replayed `steps` times back to back, so the host never holds the GPU up. An NSA cache
    holds a graph for the steps that complete a compressed block and one for the others: each is replayed
    `steps` times and the mean weighs them as a long decode meets them (`mean_step_ms`). None where the
    cache holds no graph. The replays advance the cache's device position only: the cache is spent
    afterwards, and it must have room for `steps + 1` more tokens a graph."""
    from nsa_eval.methods import StaticDecodeCache

    if isinstance(cache, StaticDecodeCache):
        graph = cache.decode_graph
        return None if graph is None else _replay_ms(lambda: graph(token)[0], steps)  # [B, 1, V]
    graphs = getattr(cache, "decode_graphs", {})
    if not graphs:
        return None
    x = model.get_input_embeddings()(token)  # [B, 1, C]
    ms = {completes: _replay_ms(lambda graph=graph: model.lm_head(graph(x)[0]), steps)
          for completes, graph in graphs.items()}
    return mean_step_ms(ms, cache.stride)


def mean_step_ms(ms: dict[bool, float], stride: int) -> float:
    """The mean GPU ms of an NSA decode step from its two graphs' `ms` (by whether the step completes a
    compressed block): one step in `stride` completes one. With one graph captured, its time."""
    if len(ms) == 1:
        return next(iter(ms.values()))
    return (ms[True] + (stride - 1) * ms[False]) / stride


def _replay_ms(step, steps: int) -> float:
    """GPU ms of `step` (a graph replay), run once, then `steps` times back to back."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / steps


def graph_step_ms(model, ids: torch.Tensor, steps: int) -> float:
    """GPU ms of one decode step of an NSA model after the prompt `ids` `[B, T]` (graph_replay_ms)."""
    with torch.no_grad(), model.attention_stats_paused():
        cache, token = prefill(model, ids)
        cache.reserve(cache.length + 1 + cache.stride + 2 * (steps + 1))  # every replay writes a position
        token = decode_step(model, cache, token)  # runs eagerly, then captures its kind of step
        ms = graph_replay_ms(model, cache, capture_both_graphs(model, cache, token), steps)
    if ms is None:
        raise RuntimeError("the NSA model did not capture its decode step")
    return ms

"""Harness benchmark: what a user waits for, a prompt through a whole model, for every attention method.

Every method runs on a random model of one shape (default: Llama-3.2-1B's), loaded from a checkpoint
folder the way `nsa-eval run` loads one, and each figure is one cell of the report's tables:
- prefill (batch 1): the model's forward over the prompt, filling its cache (the logits of the last
  position only, as generation needs), one warm-up call and then up to `repeats` timed calls;
- decode (each decode batch): from a cache filled once (batch 1 reuses the prefill's), the wall time
  per token of `repeats` rounds of `decode_tokens` steps; a step is the model's forward of one token
  with its cache and the next token's argmax, on the device. The first step (it may compile and
  capture) is timed alone. Beside it, the step's memory floor (floor.py) and, for nsa, the GPU time of
  one step from replays of its CUDA graph and the output head back to back (no host work between);
- generation throughput (full and nsa, when asked): tokens per second of lm-eval's own generation
  call with sampling (T = 0.7, top-p 0.95, as configs/paper.yaml's AIME entries), at batch 16;
- peak memory above the weights and the memory the cache holds after the prefill; Triton
  compilations during the timed decode (a compilation after warm-up stalls generation).

Each figure runs under a time cap: a figure past it stops (checked before every forward of the model
and of each decoder layer, and between timed calls) and is reported as "timeout"; a GPU out of memory
is reported as "OOM"; either way the table goes on with the next figure, and figures whose outcome
follows (a longer prompt of a method whose prefill ran past the cap, a batch that ran out of memory
at a shorter length) are "skipped". Rows are written as they finish (harness_store.py).

Rows: `transformers` (lm-eval's stock `hf` model on the same Llama checkpoint, no nsa-eval: the
adapter's own overhead shows against the `full` row), `full`, `sink_window`, `topk`, `quest`, `h2o`
(nsa-eval's attention methods on the Llama checkpoint at the given budget) and `nsa` (an NSA model of
the same shape, the paper's block sizes). Ratios are to `full` measured in the same run.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nsa_eval.bench import floor
from nsa_eval.bench.harness_store import Figure, HarnessStore

METHODS = ("transformers", "full", "sink_window", "topk", "quest", "h2o", "nsa")
BASELINES = ("full", "sink_window", "topk", "quest", "h2o")
THROUGHPUT_METHODS = ("full", "nsa")
# lm-eval's generate_until settings of configs/paper.yaml's AIME entries
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.95)
WARM_UP_STEPS = 2  # decode steps before the timed rounds: the first may compile and capture a graph


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
    budget: int = 2560
    sink: int = 128
    local: int = 512
    device: str = "cuda"
    dtype: str = "bfloat16"
    throughput_tokens: int = 0  # 0: no throughput row
    throughput_batch: int = 16
    throughput_prompt: int = 256
    throughput_cap_s: float = 540.0  # a 16k-token generation at batch 16 takes minutes, not seconds

    def cap_of(self, kind: str) -> float:
        return self.throughput_cap_s if kind == "throughput" else self.cap_s

    def settings(self) -> dict:
        """What every figure depends on: a results folder holds figures of one such setting."""
        return {"shape": asdict(self.shape), "dtype": self.dtype, "budget": self.budget, "sink": self.sink,
                "local": self.local, "decode_tokens": self.decode_tokens, "repeats": self.repeats,
                "device": device_name(self.device)}

    @property
    def max_length(self) -> int:
        """Context the models are built for: the longest prompt and every step the harness takes after it
        (warm-up, timed rounds and nsa's graph replays), or the throughput's prompt and generation."""
        decode = max(self.lengths, default=0) + WARM_UP_STEPS + 2 * self.repeats * self.decode_tokens
        return max(decode, self.throughput_prompt + self.throughput_tokens) + 8


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
    apply_attention(lm.model, method, budget=config.budget, sink=config.sink, local=config.local)
    return lm


# --------------------------------------------------------------------------------------------- figures


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    """Let the GPU finish what a stopped figure queued, and give its memory back before the next one."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def _gib_since(device: str, base: int, peak: bool = False) -> float | None:
    if not device.startswith("cuda"):
        return None
    now = torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    return (now - base) / 2**30


def _prompt(batch: int, length: int, vocab: int, device: str) -> torch.Tensor:
    """Random token ids `[batch, length]`, the same for every method at one (batch, length)."""
    generator = torch.Generator().manual_seed(length * 1000 + batch)
    return torch.randint(3, min(vocab, 8192), (batch, length), generator=generator).to(device)


def prefill(model, ids: torch.Tensor):
    """The prompt `ids` `[B, T]` through `model`: its filled cache and the next tokens `[B, 1]` (argmax of
    the last position's logits, the only ones computed)."""
    from nsa_eval.models.modeling_nsa import CACHE_FIELD

    out = model(ids, use_cache=True, logits_to_keep=1)
    return getattr(out, CACHE_FIELD), out.logits[:, -1].argmax(-1, keepdim=True)


def decode_step(model, cache, token: torch.Tensor) -> torch.Tensor:
    """One generation step from `cache`: `token` `[B, 1]` in, the next tokens `[B, 1]` out (no host sync)."""
    from nsa_eval.models.modeling_nsa import CACHE_FIELD

    logits = model(token, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache}).logits  # [B, 1, V]
    return logits[:, -1].argmax(-1, keepdim=True)


def graph_replay_ms(model, cache, token: torch.Tensor, steps: int) -> float | None:
    """GPU ms of one decode step of an NSA model whose `cache` captured its decode graph: the graph and
    the output head replayed `steps` times back to back, so the host never holds the GPU up. None where
    the cache holds no graph. The replays advance the cache's device position only: the cache is spent
    afterwards, and it must have room for `steps` more tokens."""
    graph = getattr(cache, "decode_graph", None)
    if graph is None:
        return None
    x = model.get_input_embeddings()(token)  # [B, 1, C]

    def step():
        hidden, _ = graph(x)
        return model.lm_head(hidden)  # [B, 1, V]

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
        cache.reserve(cache.length + steps + 2)  # every replay writes one more position
        token = decode_step(model, cache, token)  # runs eagerly, then captures the step
        ms = graph_replay_ms(model, cache, token, steps)
    if ms is None:
        raise RuntimeError("the NSA model did not capture its decode step")
    return ms


@dataclass
class Loaded:
    """One row's model and what its floor needs."""

    lm: object
    method: str
    weight_bytes: int
    layout: floor.KVLayout
    reads: floor.NSAReads | None

    @property
    def model(self):
        return self.lm.model


def measure_prefill(loaded: Loaded, length: int, config: HarnessConfig):
    """The prefill figure at `length`, and (cache, next tokens, memory base, cache GiB) for the batch-1
    decode figure when it got one."""
    device, model = config.device, loaded.model
    figure = Figure("prefill", loaded.method, length, 1, cap_s=config.cap_s)
    deadline, times, kept = Deadline(config.cap_s), [], None
    base = _allocated(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        ids = _prompt(1, length, config.shape.vocab, device)
        with torch.no_grad(), watched(model, deadline):
            for call in range(1 + config.repeats):  # call 0 warms up (compiles)
                if times and deadline.elapsed + times[-1] / 1000 > config.cap_s:
                    break  # the next call would end past the cap: keep what finished
                kept = None
                _sync(device)
                start = time.perf_counter()
                kept = prefill(model, ids)
                _sync(device)
                if call:
                    times.append((time.perf_counter() - start) * 1000)
    except FigureTimeout:
        kept = None
        if not times:
            figure.status = "timeout"
    except torch.OutOfMemoryError:
        kept, figure.status = None, "OOM"
    if times and figure.status == "ok":
        figure.ms, figure.calls = statistics.median(times), len(times)
    figure.cache_gib = _gib_since(device, base) if kept is not None else None
    figure.peak_gib = _gib_since(device, base, peak=True)
    figure.seconds = deadline.elapsed
    return figure, (None if kept is None else (*kept, base, figure.cache_gib))


def measure_decode(loaded: Loaded, length: int, batch: int, config: HarnessConfig, bandwidth_gbs: float,
                   prefilled=None) -> Figure:
    """The decode figure at (`length`, `batch`): from `prefilled` (the batch-1 prefill's cache, next
    tokens, memory base and cache GiB) or from a prefill of its own, filled once."""
    device, model, method = config.device, loaded.model, loaded.method
    rows = floor.read_rows(method, length, budget=config.budget, sink=config.sink, local=config.local,
                           page_size=_page_size(method, config), nsa=loaded.reads)
    figure = Figure("decode", method, length, batch, cap_s=config.cap_s, weight_bytes=loaded.weight_bytes,
                    kv_bytes=loaded.layout.bytes(rows), bandwidth_gbs=bandwidth_gbs)
    deadline, rounds, cache = Deadline(config.cap_s), [], None
    if prefilled is None and device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    base = _allocated(device) if prefilled is None else prefilled[2]
    try:
        with torch.no_grad(), watched(model, deadline):
            if prefilled is None:
                cache, token = prefill(model, _prompt(batch, length, config.shape.vocab, device))
                figure.cache_gib = _gib_since(device, base)
            else:
                cache, token, _, figure.cache_gib = prefilled
            steps = config.repeats * config.decode_tokens
            if hasattr(cache, "reserve"):  # nsa: room for every step here and the graph replays after
                cache.reserve(cache.length + WARM_UP_STEPS + 2 * steps + 2)
            for warm_up in range(WARM_UP_STEPS):
                _sync(device)
                start = time.perf_counter()
                token = decode_step(model, cache, token)
                _sync(device)
                if warm_up == 0:
                    figure.first_step_ms = (time.perf_counter() - start) * 1000
            with counting_compilations() as compiled:
                for _ in range(config.repeats):
                    if rounds and deadline.elapsed + rounds[-1] * config.decode_tokens / 1000 > config.cap_s:
                        break  # the next round would end past the cap: keep what finished
                    _sync(device)
                    start = time.perf_counter()
                    for _ in range(config.decode_tokens):
                        token = decode_step(model, cache, token)
                    _sync(device)
                    rounds.append((time.perf_counter() - start) * 1000 / config.decode_tokens)
            figure.compilations = compiled[0]
            if method == "nsa" and device.startswith("cuda"):
                figure.gpu_ms = graph_replay_ms(model, cache, token, steps)
    except FigureTimeout:
        if not rounds:
            figure.status = "timeout"
    except torch.OutOfMemoryError:
        figure.status = "OOM"
    cache = token = None
    if rounds and figure.status == "ok":
        figure.ms, figure.calls = statistics.median(rounds), len(rounds)
    figure.peak_gib = _gib_since(device, base, peak=True)
    figure.seconds = deadline.elapsed
    return figure


def _page_size(method: str, config: HarnessConfig) -> int:
    if method != "quest":
        return 1
    from nsa_eval.methods import validate_params

    return validate_params("quest", budget=config.budget, sink=config.sink, local=config.local).page_size


def measure_throughput(loaded: Loaded, config: HarnessConfig) -> Figure:
    """Sampled generation through lm-eval's own call (`_model_generate`, as generate_until makes it): a
    short warm-up generation, then `throughput_tokens` new tokens for each of `throughput_batch` random
    prompts of `throughput_prompt` tokens. Past its cap (`throughput_cap_s`), the rate over the tokens
    generated so far."""
    device, batch, new = config.device, config.throughput_batch, config.throughput_tokens
    figure = Figure("throughput", loaded.method, config.throughput_prompt, batch, new_tokens=new,
                    cap_s=config.throughput_cap_s)
    deadline, forwards, start = Deadline(config.throughput_cap_s), [0], None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    base = _allocated(device)
    ids = _prompt(batch, config.throughput_prompt, config.shape.vocab, device)
    try:
        with watched(loaded.model, deadline, forwards):
            _generate(loaded.lm, ids, min(4, new))
            _sync(device)
            forwards[0], start = 0, time.perf_counter()
            _generate(loaded.lm, ids, new)
            _sync(device)
    except FigureTimeout:
        figure.status = "timeout"
    except torch.OutOfMemoryError:
        figure.status = "OOM"
    _sync(device)
    if start is not None and figure.status != "OOM":
        # each finished forward gave every sequence one token (the first, the prompt's, included)
        seconds, steps = time.perf_counter() - start, (new if figure.status == "ok" else forwards[0])
        if steps > 0:
            figure.tokens_per_s, figure.ms = batch * steps / seconds, seconds * 1000 / steps
            if figure.status != "ok":
                figure.note = f"over the first {steps} of {new} tokens"
    figure.peak_gib = _gib_since(device, base, peak=True)
    figure.seconds = deadline.elapsed
    return figure


def _generate(lm, ids: torch.Tensor, new_tokens: int):
    """lm-eval's generation call with the AIME entries' sampling, exactly `new_tokens` tokens, no stop
    strings."""
    return lm._model_generate(ids, ids.shape[1] + new_tokens, [], min_new_tokens=new_tokens,
                              attention_mask=torch.ones_like(ids), **SAMPLING)


# ------------------------------------------------------------------------------------------------- run


def planned(config: HarnessConfig, method: str) -> list[tuple]:
    """The keys of `method`'s figures, in the order they run."""
    keys = []
    for length in sorted(config.lengths):
        keys.append(("prefill", method, length, 1, None))
        keys += [("decode", method, length, batch, None) for batch in sorted(config.decode_batches)]
    if config.throughput_tokens and method in THROUGHPUT_METHODS:
        keys.append(("throughput", method, config.throughput_prompt, config.throughput_batch,
                     config.throughput_tokens))
    return keys


def skip_reason(key: tuple, figures: dict[tuple, Figure], cap_s: float) -> str:
    """Why the figure `key` need not run, given the figures so far ("" when it must run): a method whose
    batch-1 prefill ran past the cap or out of memory at some length is neither prefilled nor decoded
    from there on; a batch is not decoded past the length where it ran out of time or memory; and a
    batch whose prefill alone would take longer than the cap (batch x the batch-1 prefill) is not
    started."""
    kind, method, length, batch, _ = key
    if kind == "throughput":
        return ""
    for (k, m, t, b, _), f in figures.items():
        if m != method or f.status not in ("timeout", "OOM"):
            continue
        what = "ran past the cap" if f.status == "timeout" else "ran out of memory"
        if k == "prefill" and (t < length or (t == length and kind == "decode")):
            return f"the batch-1 prefill {what} at {t}"
        if k == "decode" and kind == "decode" and b == batch and t < length:
            return f"batch {batch} {what} at {t}"
    one = figures.get(("prefill", method, length, 1, None))
    if kind == "decode" and batch > 1 and one is not None and one.ms is not None:
        estimate = batch * one.ms / 1000
        if estimate > cap_s:
            return f"its prefill would take about {estimate:.0f} s ({batch} x the batch-1 prefill)"
    return ""


def run_harness(config: HarnessConfig, store: HarnessStore, *, fresh: bool = False, command: str = "",
                aime: list | None = None, log: Callable[[str], None] = print,
                load: Callable = load_lm) -> list[Figure]:
    """Every figure of `config` not already in `store`, written there as each finishes; returns all the
    store's figures. Each model is loaded once, and only when it has a figure to run."""
    from nsa_eval.bench.harness_report import write_report
    from nsa_eval.bench.kernels import software_versions

    clock = Deadline(float("inf"))
    device = config.device
    dtype = getattr(torch, config.dtype)
    nbytes = 2**30 if device.startswith("cuda") else 2**26
    bandwidth = floor.copy_bandwidth_gbs(device, nbytes)
    log(f"[{clock.elapsed:7.1f} s] copy bandwidth {bandwidth:,.0f} GB/s ({nbytes / 2**20:,.0f} MiB copied on "
        f"{device_name(device)})")
    run = {"command": command, "versions": software_versions(), "bandwidth_gbs": bandwidth,
           "copy_mib": nbytes / 2**20, "cap_s": config.cap_s}
    if config.throughput_tokens:
        run["throughput_cap_s"] = config.throughput_cap_s
    extra = {} if aime is None else {"aime": [asdict(entry) for entry in aime]}
    figures = {f.key: f for f in store.open(config.settings(), run, fresh=fresh, **extra)}
    if figures:
        log(f"[{clock.elapsed:7.1f} s] {len(figures)} figures kept from earlier runs in {store.folder}")
    with tempfile.TemporaryDirectory(prefix="nsa-eval-harness-") as tmp:
        checkpoints: dict[str, Path] = {}
        for method in config.methods:
            todo = [k for k in planned(config, method)
                    if k not in figures or not figures[k].settled(config.cap_of(k[0]))]
            if not todo:
                continue
            kind = "nsa" if method == "nsa" else "llama"
            if kind not in checkpoints:
                log(f"[{clock.elapsed:7.1f} s] writing the random {kind} checkpoint")
                checkpoints[kind] = write_checkpoint(kind, config.shape, Path(tmp), config.max_length, dtype,
                                                     device)
                _free(device)
            log(f"[{clock.elapsed:7.1f} s] loading {method}")
            lm = load(method, checkpoints[kind], config)
            loaded = Loaded(lm, method, floor.weight_bytes(lm.model), floor.layout_of(lm.model),
                            floor.nsa_reads_of(lm.model) if method == "nsa" else None)
            prefilled = None
            for key in todo:
                kind_, _, length, batch, _ = key
                if kind_ != "decode" or batch != 1:
                    prefilled = None  # only the batch-1 decode at the prefill's length reuses its cache
                    _free(device)
                reason = skip_reason(key, figures, config.cap_s)
                label = _label(key)
                if reason:
                    figure = Figure(kind_, method, length, batch, status="skipped",
                                    cap_s=config.cap_of(kind_), note=reason, new_tokens=key[4])
                else:
                    log(f"[{clock.elapsed:7.1f} s] {label} ...")
                    if kind_ == "prefill":
                        figure, prefilled = measure_prefill(loaded, length, config)
                        if ("decode", method, length, 1, None) not in todo:
                            prefilled = None
                    elif kind_ == "decode":
                        figure = measure_decode(loaded, length, batch, config, bandwidth, prefilled)
                        prefilled = None
                    else:
                        figure = measure_throughput(loaded, config)
                    _free(device)
                figures[key] = figure
                store.append(figure)
                write_report(store, list(figures.values()))
                log(f"[{clock.elapsed:7.1f} s] {label}: {describe(figure)}")
            prefilled = loaded = lm = None
            _free(device)
    log(f"[{clock.elapsed:7.1f} s] done: {store.csv_path}, {store.md_path}")
    return list(figures.values())


def _label(key: tuple) -> str:
    kind, method, length, batch, new = key
    if kind == "throughput":
        return f"{method} throughput, batch {batch}, {new} new tokens after {length}"
    return f"{method} {length} {kind}, batch {batch}"


def describe(figure: Figure) -> str:
    """One progress line's result."""
    status = "" if figure.status == "ok" else f"{figure.status}{f' ({figure.note})' if figure.note else ''}"
    if figure.ms is None:
        return status
    took = f" in {figure.seconds:.1f} s" if figure.seconds is not None else ""
    if figure.kind == "prefill":
        text = f"{figure.ms:.1f} ms ({figure.calls} calls{took})"
    elif figure.kind == "decode":
        floor_ms = figure.floor_ms
        text = f"{figure.ms:.2f} ms/token ({figure.calls} rounds{took})"
        if floor_ms:
            text += f", {figure.ms / floor_ms:.1f}x its floor {floor_ms:.2f} ms"
        if figure.gpu_ms is not None:
            text += f", GPU step {figure.gpu_ms:.2f} ms"
    else:
        text = f"{figure.tokens_per_s:,.0f} tokens/s ({figure.ms:.2f} ms per step{took})"
    return f"{text}{', ' + status if status else ''}"

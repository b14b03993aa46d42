"""Harness benchmark: what a user waits for, a prompt through a whole model and the lm-eval adapter.

Every attention method runs on a random model of one shape (default: Llama-3.2-1B's), loaded from a
checkpoint folder the way `nsa-eval run` loads one, and is timed through the calls lm-eval makes:
- prefill: `_model_generate` with one new token (the prompt's forward and one step), batch 1;
- decode: the time per new token of `_model_generate` at each decode batch, from two generations
  of different lengths (their difference divided by the extra tokens, so the prefill cancels);
- peak memory: `torch.cuda.max_memory_allocated` over the prefill and the decode;
- Triton compilations during the timed decode (a compilation after warm-up stalls generation);
- nsa only: the GPU time of one decode step, from replays of its CUDA graph and the output head back
  to back (no host work between them), against which the decode's wall time per token shows the
  host's share; and a generation's first decode step (run eagerly, then captured), which the
  decode figure leaves out.

Rows: `transformers` (lm-eval's stock `hf` model on the same Llama checkpoint, no nsa-eval: the
adapter's own overhead shows against the `full` row), `full`, `sink_window`, `topk`, `quest`, `h2o`
(nsa-eval's attention methods on the Llama checkpoint at the given budget) and `nsa` (an NSA model of
the same shape, the paper's block sizes). Ratios are to `full` measured in the same run.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nsa_eval.bench.kernels import software_versions
from nsa_eval.budget import BudgetConfig

METHODS = ("transformers", "full", "sink_window", "topk", "quest", "h2o", "nsa")
BASELINES = ("full", "sink_window", "topk", "quest", "h2o")


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


@dataclass
class Measurement:
    """One method at one length: milliseconds, GiB and compilations (None where not measured)."""

    method: str
    length: int
    prefill_ms: float | None = None
    decode_ms: dict[int, float] = field(default_factory=dict)  # decode batch -> ms per new token
    peak_gib: float | None = None
    compilations: int | None = None  # Triton kernels compiled during the timed decode
    decode_gpu_ms: dict[int, float] = field(default_factory=dict)  # decode batch -> GPU ms per step (nsa)
    first_step_ms: float | None = None  # nsa, batch 1: a generation's first decode step (eager + capture)
    error: str = ""  # "out of memory" where the GPU ran out in the prefill
    decode_errors: dict[int, str] = field(default_factory=dict)  # decode batch -> "out of memory"


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


def write_checkpoints(shape: ModelShape, folder: Path, max_length: int, dtype: torch.dtype,
                      device: str) -> dict[str, Path]:
    """Random Llama and NSA checkpoints of `shape` under `folder`, with the bundled tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nsa_eval.models.configuration_nsa import NSAConfig
    from nsa_eval.models.loading import resolve_checkpoint
    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    tokenizer_dir = Path(resolve_checkpoint("nsa-tiny"))
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rope_theta=shape.rope_theta,
                  max_position_embeddings=max_length, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    made = {}
    for name, config, cls in (("llama", LlamaConfig(**common), LlamaForCausalLM),
                              ("nsa", NSAConfig(**common), NSAForCausalLM)):
        torch.manual_seed(0)
        with torch.device(device):
            model = cls(config).to(dtype)
        path = folder / name
        model.save_pretrained(path)
        del model
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / file, path / file)
        made[name] = path
    return made


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median wall time of `fn` in ms over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _generate(lm, ids: torch.Tensor, new_tokens: int):
    """lm-eval's generation call: greedy, no stop strings, exactly `new_tokens` tokens."""
    return lm._model_generate(ids, ids.shape[1] + new_tokens, [], do_sample=False, min_new_tokens=new_tokens,
                              attention_mask=torch.ones_like(ids))


def measure(lm, method: str, length: int, *, decode_batches: tuple[int, ...], decode_tokens: int,
            repeats: int, device: str, vocab: int) -> Measurement:
    """Prefill, decode and peak memory of one loaded model at one prompt length."""
    result = Measurement(method, length)
    generator = torch.Generator().manual_seed(length)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        prompt = torch.randint(3, vocab, (1, length), generator=generator).to(device)
        result.prefill_ms = _timed(lambda: _generate(lm, prompt, 1), device, repeats)
    except torch.OutOfMemoryError:
        result.error = "out of memory"
        _release(cuda)
        return result
    result.compilations = 0
    for batch in decode_batches:
        try:
            ids = torch.randint(3, vocab, (batch, length), generator=generator).to(device)
            short = _timed(lambda ids=ids: _generate(lm, ids, 2), device, repeats)
            with counting_compilations() as count:
                long = _timed(lambda ids=ids: _generate(lm, ids, 2 + decode_tokens), device, repeats)
            result.compilations += count[0]
            result.decode_ms[batch] = (long - short) / decode_tokens
            if method == "nsa" and cuda:
                result.decode_gpu_ms[batch] = graph_step_ms(lm.model, ids, repeats * decode_tokens)
                if batch == 1:  # two new tokens against one: the first decode step, captured after it ran
                    result.first_step_ms = short - result.prefill_ms
        except torch.OutOfMemoryError:
            result.decode_errors[batch] = "out of memory"
        _release(cuda)
    if cuda:
        result.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    return result


def graph_step_ms(model, ids: torch.Tensor, steps: int) -> float:
    """GPU ms of one decode step of an NSA model after the prompt `ids` `[B, T]`: its captured graph and
    the output head, replayed `steps` times back to back, so the host never holds the GPU up."""
    from nsa_eval.models.modeling_nsa import CACHE_FIELD

    with torch.no_grad(), model.attention_stats_paused():
        cache = getattr(model.model(ids, use_cache=True), CACHE_FIELD)  # hidden states only, no logits
        cache.reserve(cache.length + steps + 2)  # every replay writes one more position
        model(ids[:, -1:], cache=cache)  # runs eagerly, then captures the step
        if cache.decode_graph is None:
            raise RuntimeError("the NSA model did not capture its decode step")
        x = model.get_input_embeddings()(ids[:, -1:])  # [B, 1, C]

        def step():
            hidden, _ = cache.decode_graph(x)
            return model.lm_head(hidden)  # [B, 1, V]

        step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / steps


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def run_harness(shape: ModelShape, lengths: list[int], *, methods: tuple[str, ...] = METHODS,
                decode_batches: tuple[int, ...] = (1, 16), decode_tokens: int = 16, repeats: int = 3,
                budget: int = BudgetConfig.budget, sink: int = BudgetConfig.sink,
                local: int = BudgetConfig.local, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16, log: Callable[[str], None] = print) -> list[Measurement]:
    """Every method in `methods` at every length; each model is loaded once and kept for its lengths."""
    from lm_eval.models.huggingface import HFLM

    from nsa_eval.methods import apply_attention
    from nsa_eval.models.lm_adapter import NSAEvalLM

    max_length = max(lengths) + decode_tokens + 8
    dtype_name = str(dtype).removeprefix("torch.")
    results = []
    with tempfile.TemporaryDirectory(prefix="nsa-eval-harness-") as tmp:
        checkpoints = write_checkpoints(shape, Path(tmp), max_length, dtype, device)
        for method in methods:
            if method == "transformers":
                lm = HFLM(pretrained=str(checkpoints["llama"]), dtype=dtype_name, device=device,
                          max_length=max_length)
            elif method == "nsa":
                lm = NSAEvalLM(str(checkpoints["nsa"]), attention="nsa", dtype=dtype_name, device=device,
                               max_length=max_length)
            else:
                lm = NSAEvalLM(str(checkpoints["llama"]), attention="full", dtype=dtype_name, device=device,
                               max_length=max_length)
                apply_attention(lm.model, method, budget=budget, sink=sink, local=local)
            for length in lengths:
                row = measure(lm, method, length, decode_batches=decode_batches, decode_tokens=decode_tokens,
                              repeats=repeats, device=device, vocab=min(shape.vocab, 8192))
                log(_progress(row))
                results.append(row)
            del lm
            gc.collect()
    return results


def _progress(row: Measurement) -> str:
    if row.error:
        return f"{row.method:>12} {row.length:>6}: {row.error}"
    decode = ", ".join([f"B={b} {ms:.2f} ms/token" for b, ms in row.decode_ms.items()]
                       + [f"B={b} {error}" for b, error in row.decode_errors.items()])
    peak = f", peak {row.peak_gib:.2f} GiB" if row.peak_gib is not None else ""
    return f"{row.method:>12} {row.length:>6}: prefill {row.prefill_ms:.1f} ms, {decode}{peak}"


def _ratio(value: float | None, full: float | None) -> str:
    if value is None or not full:
        return ""
    return f" ({value / full:.2f}x)"


def markdown_report(rows: list[Measurement], *, shape: ModelShape, budget: int, sink: int, local: int,
                    command: str = "", versions: str = "") -> str:
    """The tables: prefill, decode per batch and peak memory, each with its ratio to `full`."""
    lengths = sorted({r.length for r in rows})
    batches = sorted({b for r in rows for b in (*r.decode_ms, *r.decode_errors)})
    methods = [m for m in METHODS if any(r.method == m for r in rows)]
    by_key = {(r.method, r.length): r for r in rows}
    lines = [
        "# Harness benchmark: whole models through the lm-eval adapter",
        "",
        f"Random models of shape {json.dumps(asdict(shape))}; budget {budget} = {sink} sink + {local} local "
        f"+ {budget - sink - local} chosen for the baselines; NSA at the paper's l = 32, d = 16, l' = 64, "
        "n = 16, w = 512. Milliseconds (medians), ratio to `full` of the same run in brackets.",
        "",
    ]
    if command:
        lines += [f"Command: `{command}`", ""]
    if versions:
        lines += [versions, ""]
    labels = " | ".join(f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in lengths)
    header = f"| method | {labels} |"
    rule = "|---" * (len(lengths) + 1) + "|"

    def table(title: str, value: Callable[[Measurement], float | None], digits: int,
              batch: int | None = None) -> None:
        lines.extend([f"## {title}", "", header, rule])
        for method in methods:
            cells = []
            for t in lengths:
                row, full = by_key.get((method, t)), by_key.get(("full", t))
                v = None if row is None or row.error else value(row)
                if row is not None and (row.error or row.decode_errors.get(batch)):
                    cells.append(row.error or row.decode_errors[batch])
                elif v is None:
                    cells.append("")
                else:
                    base = value(full) if full is not None and not full.error else None
                    cells.append(f"{v:.{digits}f}" + _ratio(v, base))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")

    table("Prefill, batch 1 (ms)", lambda r: r.prefill_ms, 1)
    for b in batches:
        table(f"Decode per token, batch {b} (ms)", lambda r, b=b: r.decode_ms.get(b), 2, batch=b)
    gpu_batches = sorted({b for r in rows for b in r.decode_gpu_ms})
    if gpu_batches:
        lines.extend(["## NSA decode: GPU time per step and the wall time's multiple of it", "",
                      f"| batch | {labels} |", rule])
        for b in gpu_batches:
            cells = []
            for t in lengths:
                row = by_key.get(("nsa", t))
                gpu = row.decode_gpu_ms.get(b) if row is not None else None
                wall = row.decode_ms.get(b) if row is not None else None
                cells.append("" if gpu is None or wall is None else f"{gpu:.2f} ({wall / gpu:.2f}x)")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        firsts = [(t, by_key[("nsa", t)].first_step_ms) for t in lengths if ("nsa", t) in by_key]
        firsts = ", ".join(f"{ms:.1f} ms at {t}" for t, ms in firsts if ms is not None)
        if firsts:
            lines.extend(["", "A generation's first decode step at batch 1 (eager, then captured): "
                          f"{firsts}."])
        lines.append("")
    table("Peak GPU memory (GiB)", lambda r: r.peak_gib, 2)
    table("Triton compilations during the timed decode", lambda r: r.compilations, 0)
    return "\n".join(lines)


def write_outputs(rows: list[Measurement], out_dir: str | Path, **report_kwargs) -> tuple[Path, Path]:
    """harness.csv (one row per method, length and decode batch) and harness.md under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / "harness.csv", out / "harness.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "length", "prefill_ms", "decode_batch", "decode_ms_per_token",
                         "decode_gpu_ms_per_step", "first_step_ms", "peak_gib", "compilations", "error"])
        for r in rows:
            decode = [(b, ms, "") for b, ms in r.decode_ms.items()]
            decode += [(b, None, error) for b, error in r.decode_errors.items()]
            for batch, ms, error in decode or [(None, None, "")]:
                writer.writerow([r.method, r.length, r.prefill_ms, batch, ms, r.decode_gpu_ms.get(batch),
                                 r.first_step_ms if batch == 1 else None, r.peak_gib, r.compilations,
                                 r.error or error])
    md_path.write_text(markdown_report(rows, versions=software_versions(), **report_kwargs) + "\n")
    return csv_path, md_path

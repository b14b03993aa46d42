"""One run of the harness (harness.py says what is measured): each figure under its cap, the figures it
decides skipped, every row written as it finishes (harness_store.py) and the report rebuilt after it
(harness_report.py)."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nsa_eval.bench import floor
from nsa_eval.bench.harness import (
    SAMPLING,
    THROUGHPUT_METHODS,
    WARM_UP_STEPS,
    Deadline,
    FigureTimeout,
    HarnessConfig,
    capture_both_graphs,
    counting_compilations,
    decode_room,
    decode_step,
    device_name,
    free_memory,
    graph_replay_ms,
    load_lm,
    prefill,
    random_prompt,
    sync,
    watched,
    write_checkpoint,
)
from nsa_eval.bench.harness_store import Figure, HarnessStore


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def _gib_since(device: str, base: int, peak: bool = False) -> float | None:
    if not device.startswith("cuda"):
        return None
    now = torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    return (now - base) / 2**30


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
    began, deadline, times, kept = time.monotonic(), Deadline(config.warm_up_cap_s), [], None
    base = _allocated(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        ids = random_prompt(1, length, config.shape.vocab, device)
        with torch.no_grad(), watched(model, deadline):
            for call in range(1 + config.repeats):  # call 0 warms up (compiles)
                if call == 1:
                    figure.warmup_s = time.monotonic() - began
                    deadline.restart(config.cap_s)
                if times and deadline.elapsed + times[-1] / 1000 > config.cap_s:
                    break  # the next call would end past the cap: keep what finished
                kept = None
                sync(device)
                start = time.perf_counter()
                kept = prefill(model, ids, decode_room(config))
                sync(device)
                if call:
                    times.append((time.perf_counter() - start) * 1000)
    except FigureTimeout:
        kept = None
        if not times:
            figure.status, figure.note = "timeout", _warm_up_note(figure, config)
    except torch.OutOfMemoryError:
        kept, figure.status = None, "OOM"
    if times and figure.status == "ok":
        figure.ms, figure.calls = statistics.median(times), len(times)
    figure.cache_gib = _gib_since(device, base) if kept is not None else None
    figure.peak_gib = _gib_since(device, base, peak=True)
    figure.seconds = time.monotonic() - began
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
    began, deadline, rounds, cache = time.monotonic(), Deadline(config.warm_up_cap_s), [], None
    if prefilled is None and device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    base = _allocated(device) if prefilled is None else prefilled[2]
    try:
        with torch.no_grad(), watched(model, deadline):
            if prefilled is None:
                cache, token = prefill(model, random_prompt(batch, length, config.shape.vocab, device),
                                       decode_room(config))
                figure.cache_gib = _gib_since(device, base)
            else:
                cache, token, _, figure.cache_gib = prefilled
            steps = config.repeats * config.decode_tokens
            if hasattr(cache, "reserve"):  # room for every step here and the graph replays after
                cache.reserve(cache.length + decode_room(config))
            for warm_up in range(WARM_UP_STEPS):
                sync(device)
                start = time.perf_counter()
                token = decode_step(model, cache, token)
                sync(device)
                if warm_up == 0:
                    figure.first_step_ms = (time.perf_counter() - start) * 1000
            figure.warmup_s = time.monotonic() - began
            deadline.restart(config.cap_s)
            with counting_compilations() as compiled:
                for _ in range(config.repeats):
                    if rounds and deadline.elapsed + rounds[-1] * config.decode_tokens / 1000 > config.cap_s:
                        break  # the next round would end past the cap: keep what finished
                    sync(device)
                    start = time.perf_counter()
                    for _ in range(config.decode_tokens):
                        token = decode_step(model, cache, token)
                    sync(device)
                    rounds.append((time.perf_counter() - start) * 1000 / config.decode_tokens)
            figure.compilations = compiled[0]
            if device.startswith("cuda"):  # every method whose cache captured its step
                token = capture_both_graphs(model, cache, token)  # short rounds may have met one kind
                figure.gpu_ms = graph_replay_ms(model, cache, token, steps)
    except FigureTimeout:
        if not rounds:
            figure.status, figure.note = "timeout", _warm_up_note(figure, config)
    except torch.OutOfMemoryError:
        figure.status = "OOM"
    cache = token = None
    if rounds and figure.status == "ok":
        figure.ms, figure.calls = statistics.median(rounds), len(rounds)
    figure.peak_gib = _gib_since(device, base, peak=True)
    figure.seconds = time.monotonic() - began
    return figure


def _warm_up_note(figure: Figure, config: HarnessConfig) -> str:
    """Why a figure with nothing timed ran past a cap: in its warm-up, or in its first timed call."""
    if figure.warmup_s is None:
        return f"its warm-up ran past {config.warm_up_cap_s:g} s"
    return ""


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
    ids = random_prompt(batch, config.throughput_prompt, config.shape.vocab, device)
    try:
        with watched(loaded.model, deadline, forwards):
            _generate(loaded.lm, ids, min(4, new))
            sync(device)
            forwards[0], start = 0, time.perf_counter()
            _generate(loaded.lm, ids, new)
            sync(device)
    except FigureTimeout:
        figure.status = "timeout"
    except torch.OutOfMemoryError:
        figure.status = "OOM"
    sync(device)
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
    batch-1 prefill ran past the cap, out of memory or into an error at some length is neither prefilled
    nor decoded from there on; a batch is not decoded past the length where it did so; and a
    batch whose prefill alone would take longer than the cap (batch x the batch-1 prefill) is not
    started."""
    kind, method, length, batch, _ = key
    if kind == "throughput":
        return ""
    for (k, m, t, b, _), f in figures.items():
        if m != method or f.status not in ("timeout", "OOM", "error"):
            continue
        what = {"timeout": "ran past the cap", "OOM": "ran out of memory", "error": "failed"}[f.status]
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
           "copy_mib": nbytes / 2**20, "cap_s": config.cap_s,
           "warmup_cap_s": config.warm_up_cap_s}
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
                free_memory(device)
            log(f"[{clock.elapsed:7.1f} s] loading {method}")
            lm = load(method, checkpoints[kind], config)
            loaded = Loaded(lm, method, floor.weight_bytes(lm.model), floor.layout_of(lm.model),
                            floor.nsa_reads_of(lm.model) if method == "nsa" else None)
            prefilled = None
            for key in todo:
                kind_, _, length, batch, _ = key
                if kind_ != "decode" or batch != 1:
                    prefilled = None  # only the batch-1 decode at the prefill's length reuses its cache
                    free_memory(device)
                reason = skip_reason(key, figures, config.cap_s)
                label = _label(key)
                if reason:
                    figure = Figure(kind_, method, length, batch, status="skipped",
                                    cap_s=config.cap_of(kind_), note=reason, new_tokens=key[4])
                else:
                    log(f"[{clock.elapsed:7.1f} s] {label} ...")
                    try:
                        if kind_ == "prefill":
                            figure, prefilled = measure_prefill(loaded, length, config)
                            if ("decode", method, length, 1, None) not in todo:
                                prefilled = None
                        elif kind_ == "decode":
                            figure = measure_decode(loaded, length, batch, config, bandwidth, prefilled)
                            prefilled = None
                        else:
                            figure = measure_throughput(loaded, config)
                    except Exception as error:  # one method's failure is a cell of the table, not its end
                        message = (str(error).strip().splitlines() or [""])[0][:200]
                        figure = Figure(kind_, method, length, batch, status="error",
                                        note=f"{type(error).__name__}: {message}", new_tokens=key[4])
                        prefilled = None
                    free_memory(device)
                figures[key] = figure
                store.append(figure)
                write_report(store, list(figures.values()))
                log(f"[{clock.elapsed:7.1f} s] {label}: {describe(figure)}")
            prefilled = loaded = lm = None
            free_memory(device)
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
    if figure.warmup_s is not None and figure.seconds is not None:
        took += f", {figure.warmup_s:.1f} s of it warming up"
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

"""The training recipe of the bundled `nsa-tiny` and `full-tiny` checkpoints.

Two models with the same dimensions, data, token count and optimiser: one whose attention is NSA
(`nsa_eval.models.NSAForCausalLM`, prefill/training through `nsa_eval.kernels.nsa_attention`, the
Triton kernels on CUDA), one with full attention (a transformers `LlamaForCausalLM`, so the
training-free baselines of `nsa_eval.methods` apply to it). The paper's experiment (NSA vs full
attention pretrained on the same tokens) in miniature.

Loop: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10%,
bf16 autocast on CUDA, gradient clipping at 1.0, batches a pure function of (seed, step)
(`data.make_batch`). Logs go to `log.jsonl`/`log.csv` (training) and `evals.jsonl` (held-out text
loss and a teacher-forced NIAH probe); the checkpoint (bf16 safetensors + config + tokenizer +
training.json) to `<out>/checkpoint`.

A run is sized either by `steps` or by `minutes`: then the first steps are timed and the step count
is fixed from the measured speed before warm-up ends. A second run can copy the first's step
count (`--match`), which is how both models get identical token counts.

Runs resume: at every evaluation the model, the optimiser state, the step and the evaluations so
far go to `<out>/resume.pt` (written atomically); `stop_after_minutes` ends this process's share of
a run there, and `resume=True` continues it. Batches depend on (seed, step) only and nothing else is
random after initialisation, so a run split in parts ends with the same weights as one run (bitwise
on the CPU). The file is removed when the run finishes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from nsa_eval.train.data import (
    BatchStream,
    Corpus,
    MixConfig,
    heldout_retrieval_samples,
    heldout_text_batches,
)

# ---------------------------------------------------------------------------------------------
# configurations


@dataclass
class ModelConfig:
    """Dimensions shared by both models, and the NSA branch hyperparameters (ignored by `full`)."""

    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 8
    # 4 KV heads (G = 2): NSA selects per KV head, so each layer makes 4 independent selections,
    # which the retrieval of a 7-digit needle needs more than a larger group does (docs/training.md)
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    # NSA (paper: l=32, d=16, l'=64, n=16, w=512). At a 2,048-token training length, n=16 blocks of
    # 64 would cover the whole context, so selection and window are scaled down (docs/training.md).
    block_len: int = 32  # l
    stride: int = 16  # d
    select_size: int = 64  # l'
    num_selected: int = 8  # n, including 1 initial + 2 local blocks
    window: int = 256  # w
    compress_norm: bool = False  # an RMSNorm over the compressed keys (NSAConfig.compress_norm)
    kernel_impl: str = "auto"  # NSA kernels while training; checkpoints always say "auto"


@dataclass
class TrainConfig:
    attention: str = "nsa"  # "nsa" | "full"
    seed: int = 0
    seq_len: int = 2048
    batch_size: int = 16
    steps: int | None = None  # fixed step count, or
    minutes: float | None = None  # wall-clock budget: steps derived from the measured speed
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    num_evals: int = 12  # held-out evaluations spread over the run (plus one at step 0)
    heldout_rows: int = 32
    probe_lengths: tuple[int, ...] = (256, 1024, 2000)
    probe_per_length: int = 8
    log_every: int = 10
    calibration_steps: int = 8
    # a checkpoint (bundled name or directory) whose weights start the run instead of a fresh
    # initialisation: continued pretraining at a longer context, as the paper's long-context stage
    init_from: str | None = None
    # (n, steps): an NSA model selects n blocks a query for the first `steps` steps, then its own top-n
    # (`model.num_selected`, which its evaluations and checkpoint use throughout). A continuation at a
    # longer context otherwise rarely selects a far needle, and so rarely learns to attend to one.
    wide_selection: tuple[int, int] | None = None
    # an NSA model's loss adds this weight times the KL divergence from dense attention's mass per
    # selection block to the compressed keys' block importance, at `distill_queries` random positions a
    # row and layer (nsa_eval.train.selection_distill): the compressed keys then learn to rank blocks
    # where the compression branch's nearly closed gate passes them no gradient (0: the paper's loss)
    selection_distill: float = 0.0
    distill_queries: int = 64
    # and this weight times the same divergence at each retrieval row's answer queries (the positions
    # that predict an answer token, where a needle must be found; random positions mostly attend nearby)
    distill_answers: float = 0.0
    mix: MixConfig = field(default_factory=MixConfig)
    model: ModelConfig = field(default_factory=ModelConfig)


def tiny_config(attention: str = "nsa", **overrides) -> TrainConfig:
    """A CPU configuration for tests: a 2-layer, 64-wide model on 256-token rows."""
    model = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=1024, num_selected=3, window=64,
    )
    cfg = TrainConfig(
        attention=attention, seq_len=256, batch_size=2, steps=4, lr=3e-3, warmup_steps=2, num_evals=1,
        heldout_rows=4, probe_lengths=(128,), probe_per_length=2, log_every=1, calibration_steps=2,
        mix=MixConfig(retrieval_lengths=(64, 128), answer_weight=5.0), model=model,
    )
    return replace(cfg, **overrides)


# ---------------------------------------------------------------------------------------------
# models


def build_model(attention: str, model_config: ModelConfig, tokenizer):
    """A freshly initialised NSAForCausalLM ("nsa") or LlamaForCausalLM ("full") of `model_config`'s size."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=model_config.hidden_size,
        intermediate_size=model_config.intermediate_size,
        num_hidden_layers=model_config.num_layers,
        num_attention_heads=model_config.num_heads,
        num_key_value_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        max_position_embeddings=model_config.max_position_embeddings,
        tie_word_embeddings=model_config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if attention == "full":
        from transformers import LlamaConfig, LlamaForCausalLM

        rope = {"rope_type": "default", "rope_theta": model_config.rope_theta}
        return LlamaForCausalLM(LlamaConfig(rope_parameters=rope, **common))
    if attention == "nsa":
        from nsa_eval.models.configuration_nsa import NSAConfig
        from nsa_eval.models.modeling_nsa import NSAForCausalLM

        config = NSAConfig(
            rope_theta=model_config.rope_theta,
            compression="mlp",  # the paper's layout: MLP compression, separate keys/values per branch
            shared_kv=False,
            block_len=model_config.block_len,
            stride=model_config.stride,
            select_size=model_config.select_size,
            num_selected=model_config.num_selected,
            num_init=1,
            num_local=2,
            window=model_config.window,
            compress_norm=model_config.compress_norm,
            kernel_impl=model_config.kernel_impl,
            **common,
        )
        return NSAForCausalLM(config)
    raise ValueError(f"attention must be 'nsa' or 'full', got {attention!r}")


# ---------------------------------------------------------------------------------------------
# the loop


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine to cfg.lr * min_lr_ratio at `total`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def weighted_loss(logits, targets, weights):
    """sum(w * CE) / sum(w) over positions. logits [B, T, V], targets int64 [B, T], weights [B, T]."""
    import torch.nn.functional as F

    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # [B*T]
    ce = ce.view_as(targets)  # [B, T]
    return (ce * weights).sum() / weights.sum().clamp_min(1e-6), ce


RESUME_FILE = "resume.pt"


def train(cfg: TrainConfig, corpus: Corpus, out_dir: str | Path, *, device: str | None = None,
          workers: int = 0, echo=print, stop_after_minutes: float | None = None,
          resume: bool = False) -> dict:
    """Train one model, write logs and `<out_dir>/checkpoint`; returns the run summary dict.

    `workers` > 0 builds batches ahead in that many forked processes (the GPU run).
    `stop_after_minutes`: save `<out_dir>/resume.pt` and return `{"finished": False, ...}` once this
    process has trained that long; `resume`: continue from `<out_dir>/resume.pt` (cfg must match).
    """
    stream = BatchStream(corpus, cfg.seed, cfg.batch_size, cfg.seq_len, cfg.mix, workers=workers)
    try:
        return _train(cfg, corpus, out_dir, stream, device, echo, stop_after_minutes, resume)
    finally:
        stream.close()


def config_from_dict(d: dict) -> TrainConfig:
    """The TrainConfig a run recorded (`summary.json`'s or `resume.pt`'s "config")."""
    def tuples(x: dict) -> dict:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in x.items()}

    mix, model = MixConfig(**tuples(d["mix"])), ModelConfig(**d["model"])
    return TrainConfig(**{**tuples(d), "mix": mix, "model": model})


def load_resume_state(out_dir: str | Path) -> dict:
    """The saved state of an unfinished run (see `train`); FileNotFoundError if there is none."""
    import torch

    return torch.load(Path(out_dir) / RESUME_FILE, map_location="cpu", weights_only=True)


def _save_resume_state(out_dir: Path, **state) -> None:
    import torch

    tmp = out_dir / (RESUME_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out_dir / RESUME_FILE)  # a crash mid-write leaves the previous state


def _train(cfg: TrainConfig, corpus: Corpus, out_dir, stream, device, echo, stop_after_minutes=None,
           resume=False) -> dict:
    import torch

    if cfg.steps is None and cfg.minutes is None:
        raise ValueError("give steps or minutes")
    if cfg.wide_selection is not None and (cfg.attention != "nsa"
                                           or cfg.wide_selection[0] < cfg.model.num_selected):
        raise ValueError(f"wide_selection {cfg.wide_selection}: NSA runs only, with n >= the model's "
                         f"num_selected ({cfg.model.num_selected})")
    distilling = cfg.selection_distill > 0 or cfg.distill_answers > 0
    if (min(cfg.selection_distill, cfg.distill_answers) < 0
            or (distilling and (cfg.attention != "nsa" or cfg.distill_queries < 1))):
        raise ValueError(f"selection_distill {cfg.selection_distill}, distill_answers {cfg.distill_answers}: "
                         f"weights >= 0, above 0 for NSA runs only, with distill_queries >= 1 (got attention "
                         f"{cfg.attention!r}, distill_queries {cfg.distill_queries})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = load_resume_state(out_dir) if resume else None
    if saved is not None and saved["config"] != _jsonable(asdict(cfg)):
        raise ValueError(f"{out_dir / RESUME_FILE} was written by a run with another configuration")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    tokenizer = corpus.tokenizer
    model = build_model(cfg.attention, cfg.model, tokenizer)
    if cfg.init_from is not None and saved is None:
        load_initial_weights(model, cfg.init_from)
        echo(f"[{cfg.attention}] weights from {cfg.init_from}")
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    echo(f"[{cfg.attention}] {n_params / 1e6:.2f}M parameters on {device}")
    optimizer = _optimizer(model, cfg, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    if device.startswith("cuda"):
        _attention_inputs_in_bf16(model)

    heldout_text = heldout_text_batches(corpus, cfg.seq_len, cfg.heldout_rows, cfg.batch_size)
    probe = heldout_retrieval_samples(corpus, cfg.probe_lengths, cfg.probe_per_length,
                                      pool_length=max(cfg.mix.retrieval_lengths))
    tokens_per_step = cfg.batch_size * cfg.seq_len
    step_times: list[float] = []
    process_start = time.perf_counter()
    if saved is None:
        logger = _Logger(out_dir)
        total = cfg.steps if cfg.steps is not None else 10**9
        eval_every = max(1, total // cfg.num_evals) if cfg.steps is not None else None
        start = time.perf_counter()
        evals = [_evaluate(model, heldout_text, probe, autocast, device, 0, 0)]
        eval_seconds = time.perf_counter() - start
        logger.eval(evals[-1], time.perf_counter() - start)
        echo(f"[{cfg.attention}] step 0 {_fmt(evals[-1])}")
        step = 0
    else:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, total, eval_every, evals = saved["step"], saved["total"], saved["eval_every"], saved["evals"]
        start = time.perf_counter() - saved["elapsed"]  # elapsed times continue across the parts
        logger = _Logger(out_dir, resume_step=step)
        echo(f"[{cfg.attention}] resumed at step {step}/{total}")
    calibrating = cfg.steps is None and saved is None

    def save_state():
        _save_resume_state(out_dir, step=step, total=total, eval_every=eval_every, evals=evals,
                           elapsed=time.perf_counter() - start, config=_jsonable(asdict(cfg)),
                           model=model.state_dict(), optimizer=optimizer.state_dict())

    while step < total:
        t_step = time.perf_counter()
        _train_selection(model, cfg, step)
        ids, weights = stream.get(step)
        ids = torch.from_numpy(ids).to(device, non_blocking=True)  # [B, T+1]
        weights = torch.from_numpy(weights).to(device, non_blocking=True)  # [B, T+1]
        lr = lr_at(step, total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast, model.capturing_selection_inputs() if distilling else nullcontext() as captured:
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # [B, T, V]
        loss, ce = weighted_loss(logits, ids[:, 1:], weights[:, 1:])
        distill = _selection_distill(model, cfg, captured, step, weights[:, 1:]) if distilling else None
        if distill is not None:
            loss = loss + distill
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        _train_selection(model, cfg, None)  # evaluations, the resume state and the checkpoint: its own

        if calibrating and step <= cfg.calibration_steps + 2:
            _sync(device)
            step_times.append(time.perf_counter() - t_step)
            if step == cfg.calibration_steps + 2:  # first 2 steps compile kernels: not timed
                t_eval = time.perf_counter()  # a warm evaluation (the one at step 0 compiled kernels)
                evals.append(_evaluate(model, heldout_text, probe, autocast, device, step,
                                       step * tokens_per_step))
                logger.eval(evals[-1], time.perf_counter() - start)
                eval_seconds = time.perf_counter() - t_eval
                total, eval_every = _steps_for_budget(cfg, step, step_times[2:], eval_seconds,
                                                      time.perf_counter() - start)
                echo(f"[{cfg.attention}] {np.mean(step_times[2:]):.3f} s/step, {eval_seconds:.1f} s/eval "
                     f"-> {total} steps")
        if step % cfg.log_every == 0 or step == total:
            row = _train_row(step, tokens_per_step, lr, loss, grad_norm, ce, weights[:, 1:], ids[:, 1:],
                             logits, cfg.mix.answer_weight, time.perf_counter() - start, distill)
            logger.train(row)
            if step % (cfg.log_every * 10) == 0:
                echo(f"[{cfg.attention}] step {step}/{total} loss {row['loss']:.3f} "
                     f"text {row['text_loss']:.3f} lr {lr:.2e} {row['elapsed_s']:.0f}s")
        if eval_every and (step % eval_every == 0 or step == total):
            tokens = step * tokens_per_step
            evals.append(_evaluate(model, heldout_text, probe, autocast, device, step, tokens))
            logger.eval(evals[-1], time.perf_counter() - start)
            echo(f"[{cfg.attention}] step {step} {_fmt(evals[-1])}")
            if step < total:
                save_state()
        out_of_time = (stop_after_minutes is not None
                       and time.perf_counter() - process_start > stop_after_minutes * 60)
        if out_of_time and step < total:
            save_state()
            logger.close()
            echo(f"[{cfg.attention}] stopped at step {step}/{total} after {stop_after_minutes:g} min; "
                 f"continue with --resume (state in {out_dir / RESUME_FILE})")
            return {"attention": cfg.attention, "finished": False, "step": step, "steps": total}

    seconds = time.perf_counter() - start
    summary = {
        "attention": cfg.attention,
        "finished": True,
        "steps": step,
        "tokens": step * tokens_per_step,
        "parameters": n_params,
        "seconds": round(seconds, 1),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "final_eval": evals[-1],
        "config": _jsonable(asdict(replace(cfg, steps=step))),
        "corpus": {k: corpus.manifest.get(k) for k in ("sources", "versions", "tokens", "sha256")},
        "versions": _lib_versions(),
    }
    save_checkpoint(model, tokenizer, out_dir / "checkpoint", summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    logger.close()
    (out_dir / RESUME_FILE).unlink(missing_ok=True)
    return summary


def _train_selection(model, cfg: TrainConfig, step: int | None) -> None:
    """An NSA model's top-n for training step `step` (`cfg.wide_selection`), or its own for None."""
    if cfg.wide_selection is not None:
        n, steps = cfg.wide_selection
        model.config.num_selected = n if step is not None and step < steps else cfg.model.num_selected


def _selection_distill(model, cfg: TrainConfig, captured, step: int, weights):
    """The weighted selection losses (`cfg.selection_distill`'s at random positions, `cfg.distill_answers`'s
    at the answer queries, those whose target's loss weight `weights` `[B, T]` is the answer weight),
    averaged over the layers' captured prefill inputs; the random positions drawn from the seed and the
    step, so a resumed run draws the same."""
    import torch

    from nsa_eval.train.selection_distill import answer_distill_loss, answer_positions, selection_distill_loss

    c = model.config
    blocks = dict(block_len=c.block_len, stride=c.stride, select_size=c.select_size, num_init=c.num_init,
                  num_local=c.num_local)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    answers = (answer_positions(weights == cfg.mix.answer_weight, select_size=c.select_size,
                                num_init=c.num_init, num_local=c.num_local)
               if cfg.distill_answers > 0 else None)  # one host wait a row: only where the term is on
    losses = []
    for layer in captured:
        for q, k, k_cmp in layer:
            scale = q.shape[-1] ** -0.5
            terms = []
            if cfg.selection_distill > 0:
                terms.append(cfg.selection_distill * selection_distill_loss(
                    q, k, k_cmp, **blocks, scale=scale, queries=cfg.distill_queries, generator=generator))
            if cfg.distill_answers > 0:
                terms.append(cfg.distill_answers * answer_distill_loss(q, k, k_cmp, answers, **blocks,
                                                                       scale=scale))
            losses.append(sum(terms))
    return torch.stack(losses).mean()


def _attention_inputs_in_bf16(model) -> None:
    """Feed NSA attention layers bf16 hidden states under autocast.

    Autocast leaves the fp32 residual stream as it is; NSAAttention then rotates q/k with fp32
    cos/sin (q, k become fp32) while v stays bf16, and the kernels refuse mixed dtypes. Casting the
    layer input keeps every branch tensor in bf16, as in a bf16 model.
    """
    import torch

    for module in model.modules():
        if type(module).__name__ == "NSAAttention":
            module.register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16), *args[1:]))


def _optimizer(model, cfg: TrainConfig, device: str):
    import torch

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.startswith("cuda"))


def _steps_for_budget(cfg, done, times, eval_seconds, elapsed) -> tuple[int, int]:
    """Total steps that fit cfg.minutes at the measured speed, leaving room for the evaluations."""
    per_step = float(np.mean(times))
    remaining = cfg.minutes * 60 - elapsed - eval_seconds * cfg.num_evals
    total = max(done + 1, done + int(remaining / per_step))
    return total, max(1, total // cfg.num_evals)


def _sync(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _train_row(step, tokens_per_step, lr, loss, grad_norm, ce, weights, targets, logits, answer_weight,
               elapsed, distill=None) -> dict:
    import torch

    with torch.no_grad():
        text = weights == 1.0  # [B, T]
        answer = weights == answer_weight  # [B, T]
        correct = logits.argmax(-1) == targets  # [B, T]
        row = {
            "step": step,
            "tokens": step * tokens_per_step,
            "loss": float(loss),
            "text_loss": float(ce[text].mean()) if text.any() else float("nan"),
            "answer_loss": float(ce[answer].mean()) if answer.any() else float("nan"),
            "answer_token_acc": float(correct[answer].float().mean()) if answer.any() else float("nan"),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "elapsed_s": round(elapsed, 2),
        }
        if distill is not None:
            row["distill_loss"] = float(distill)
    return row


def _evaluate(model, heldout_text, probe, autocast, device, step, tokens) -> dict:
    """Held-out text loss (mean CE per token) and teacher-forced NIAH probe exact match; for NSA also
    the share of (layer, KV head) pairs whose selection held the needle at the first answer token."""

    import torch

    model.eval()
    total_ce, total_n = 0.0, 0
    with torch.no_grad(), autocast:
        for rows in heldout_text:
            ids = torch.from_numpy(rows).to(device)  # [b, T+1]
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # [b, T, V]
            ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(),
                                                   reduction="sum")
            total_ce += float(ce)
            total_n += ids[:, 1:].numel()
        hits, selected = [], []
        nsa = hasattr(model, "recording_selections")
        for seg_ids, seg_w in probe:
            ids = torch.from_numpy(seg_ids).to(device)[None]  # [1, L]
            with model.recording_selections() if nsa else nullcontext() as recorded:
                logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0]  # [L-1, V]
            answer = torch.from_numpy(seg_w[1:] > 0).to(device)  # [L-1]
            hits.append(bool((logits.argmax(-1) == ids[0, 1:])[answer].all()))
            if nsa:
                selected += needle_selected([layer[0][0] for layer in recorded], seg_ids, seg_w,
                                            model.config.select_size)
    model.train()
    ev = {"step": step, "tokens": tokens, "heldout_loss": total_ce / max(1, total_n),
          "probe_exact_match": float(np.mean(hits)) if hits else float("nan")}
    if selected:
        ev["probe_needle_selected"] = float(np.mean(selected))
    return ev


def needle_selected(blocks, ids, weights, select_size: int) -> list[bool]:
    """For one teacher-forced retrieval sample (`retrieval_segment`'s ids and weights `[L]`) and its
    selections (per layer `[L - 1, Hkv, n]`, `NSAModel.recording_selections`): per (layer, KV head),
    whether the query that predicts the first answer token selected every block holding the needle's
    value. Empty when the value is not found before the answer."""
    start = int(np.argmax(weights > 0))  # the first answer token: " <value>." EOS
    value = ids[start + 1 : len(ids) - 2].tolist()  # the value's inner digits (the first may carry the space)
    first = next((i for i in range(start - len(value)) if ids[i : i + len(value)].tolist() == value), None)
    if not value or first is None:
        return []
    needle = {p // select_size for p in range(first, first + len(value))}
    heads = [row for layer in blocks for row in layer[start - 1].tolist()]  # the answer query's [Hkv, n]
    return [needle <= set(row) for row in heads]


def _fmt(ev: dict) -> str:
    line = f"held-out loss {ev['heldout_loss']:.3f}, NIAH probe {ev['probe_exact_match']:.2f}"
    if "probe_needle_selected" in ev:
        line += f", needle selected {ev['probe_needle_selected']:.2f}"
    return line


class _Logger:
    def __init__(self, out_dir: Path, resume_step: int | None = None):
        self.csv_path = out_dir / "log.csv"
        self.rows: list[dict] = []
        kept_evals: list[dict] = []
        if resume_step is not None:  # keep what the earlier parts logged up to the saved step
            self.rows = [r for r in _read_jsonl(out_dir / "log.jsonl") if r["step"] <= resume_step]
            kept_evals = [e for e in _read_jsonl(out_dir / "evals.jsonl") if e["step"] <= resume_step]
        self.jsonl = open(out_dir / "log.jsonl", "w")  # noqa: SIM115 - closed in close()
        self.evals = open(out_dir / "evals.jsonl", "w")  # noqa: SIM115
        for row in self.rows:
            self.jsonl.write(json.dumps(row) + "\n")
        for ev in kept_evals:
            self.evals.write(json.dumps(ev) + "\n")

    def train(self, row: dict):
        self.rows.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def eval(self, ev: dict, elapsed: float):
        self.evals.write(json.dumps({**ev, "elapsed_s": round(elapsed, 2)}) + "\n")
        self.evals.flush()

    def close(self):
        self.jsonl.close()
        self.evals.close()
        if self.rows:
            with open(self.csv_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(self.rows[0]))
                writer.writeheader()
                writer.writerows(self.rows)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(model, tokenizer, path: str | Path, summary: dict | None = None):
    """bf16 safetensors + config.json + tokenizer files (+ training.json) in `path`."""
    import copy

    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    export = copy.deepcopy(model).to("cpu", torch.bfloat16)
    export.config.use_cache = True
    if hasattr(export.config, "kernel_impl"):
        export.config.kernel_impl = "auto"  # Triton on CUDA, the reference elsewhere
    export.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    if summary is not None:
        (path / "training.json").write_text(json.dumps(summary, indent=1))


def load_initial_weights(model, checkpoint: str | Path) -> None:
    """Copy a checkpoint's weights (bf16 safetensors of `save_checkpoint`) into `model`, in place.

    Raises ValueError when the checkpoint's parameter names or shapes differ from the model's.
    """
    import torch
    from safetensors.torch import load_file

    from nsa_eval.models.loading import resolve_checkpoint

    weights = load_file(str(Path(resolve_checkpoint(checkpoint)) / "model.safetensors"))
    own = model.state_dict()
    if model.config.tie_word_embeddings:  # saved once, under the embedding's name
        weights.setdefault("lm_head.weight", weights.get("model.embed_tokens.weight"))
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    wrong = [k for k in own if k in weights and weights[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{checkpoint} does not fit this model: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}, other shapes {wrong[:3]}")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(weights[name].to(tensor.dtype))


def load_checkpoint(path: str | Path, dtype=None):
    """(model, tokenizer) of a checkpoint written by `save_checkpoint` (either attention)."""
    from transformers import AutoModelForCausalLM

    from nsa_eval.train.tokenizer import load_tokenizer

    if json.loads((Path(path) / "config.json").read_text())["model_type"] == "llama":
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        from nsa_eval.models.modeling_nsa import NSAForCausalLM

        model = NSAForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model, load_tokenizer(path)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return [_jsonable(v) for v in obj]
    return obj


def _lib_versions() -> dict:
    import sys

    import torch
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out

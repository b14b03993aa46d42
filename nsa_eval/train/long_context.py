"""The long-context pair and its window ablation: `nsa-eval train --recipe long --out runs/long`.

Four stages, each an ordinary `train` run in its own folder under `out`:

- `nsa-nowindow-2k`: NSA without the sliding-window branch (window 0), trained from scratch with the
  bundled nsa-tiny's recipe, so on its exact tokens (seed 0, 6,000 steps of 16 x 2,048);
- `nsa`: nsa-tiny continued at 16,384 tokens (its first 800 steps on 64 selected blocks, then 16);
- `full`: full-tiny continued at 16,384 tokens, on the same tokens as `nsa`;
- `nsa-nowindow`: `nsa-nowindow-2k` continued at 16,384 tokens, on the same tokens again, as `nsa`.

With `compress_norm` (`nsa-eval train --recipe long --compress-norm`, into another `--out`) every
NSA stage has an RMSNorm on its compressed keys (`NSAConfig.compress_norm`). nsa-tiny has none, so a
fifth stage, `nsa-2k`, first trains NSA with it from scratch on nsa-tiny's exact tokens, and `nsa`
continues from there. With `selection_distill` (`--selection-distill W`, into another `--out`) the two
long NSA stages add W times the selection loss of nsa_eval/train/selection_distill.py to theirs, and
with `distill_answers` (`--distill-answers A`) A times the same loss at the answer queries. With
`far_needles` (`--far-needles F`) that share of the long stages' retrieval rows opens with a needle far
back (data.py's `MixConfig.far_needles`), for all three long models alike.

The paper pretrains at 8k and then adapts to 32k in a second stage; this is that schedule in
miniature (2,048, then 16,384). The three long models start from models that saw identical tokens
and continue on identical tokens, so they differ in attention alone. The window ablation tests the
paper's claim that the window branch keeps the other branches from learning local shortcuts: it is
trained without a window from the first step, not cut out of a trained model.

Stages whose inputs are ready run side by side, one process each on the same device (models this
small leave most of a GPU idle). Each invocation skips finished stages and resumes unfinished ones
from their `resume.pt`, so `--stop-after-minutes M` splits the recipe into parts of M minutes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from nsa_eval.train.data import MixConfig
from nsa_eval.train.recipe import RESUME_FILE, ModelConfig, TrainConfig

LONG_CONTEXT = 16384
# NIAH prompts of the evaluation reach 64k: positions past the training length must be allowed
LONG_MAX_POSITIONS = 131072
LONG_RETRIEVAL_LENGTHS = (2048, 4096, 6144, 8192, 10240, 12288, 14336, 16000)


@dataclass(frozen=True)
class Stage:
    """One training run of the recipe: its folder name, configuration and the stage it starts from."""

    name: str
    config: TrainConfig
    after: str | None = None  # a stage whose checkpoint is `config.init_from`


def long_stages(out: str | Path, *, compress_norm: bool = False, selection_distill: float = 0.0,
                distill_answers: float = 0.0, far_needles: float = 0.0) -> list[Stage]:
    """The recipe's stages in dependency order; `out` is where their folders go. `compress_norm`: the
    NSA stages' models norm their compressed keys, and NSA's 2k start is trained rather than nsa-tiny.
    `selection_distill`, `distill_answers`: the long NSA stages' weights of the selection loss at random
    positions and at the answer queries (`TrainConfig`'s). `far_needles`: the long stages' share of
    retrieval rows that open with a far needle (`MixConfig`'s)."""
    bundled = replace(TrainConfig(), steps=6000)  # nsa-tiny's recipe (tests/train check it)
    extension = replace(
        TrainConfig(),
        seq_len=LONG_CONTEXT,
        batch_size=4,
        steps=2400,  # 157M tokens; 800 (52M) left NSA's retrieval past 4k untrained (docs/training.md)
        lr=1e-3,
        warmup_steps=50,
        num_evals=6,
        heldout_rows=8,
        probe_lengths=(2000, 8000, 16000),
        probe_per_length=4,
        mix=MixConfig(retrieval_fraction=0.75, retrieval_lengths=LONG_RETRIEVAL_LENGTHS,
                      far_needles=far_needles),
        # the paper's n = 16 selected blocks: at 16k, 8 blocks of 64 leave 5 free choices among 256
        model=replace(ModelConfig(), max_position_embeddings=LONG_MAX_POSITIONS, num_selected=16),
    )
    nsa_model = replace(ModelConfig(), compress_norm=compress_norm)
    nsa_long_model = replace(extension.model, compress_norm=compress_norm)
    no_window = replace(nsa_model, window=0)
    pretrained = str(Path(out) / "nsa-nowindow-2k" / "checkpoint")
    # NSA's first third on 64 blocks a query (a quarter of 16k, the share nsa-tiny's 8 blocks had of 2k):
    # with 16 it seldom selects a far needle, so its selection branch never learns to attend that far
    # (docs/training.md); then the paper's 16
    wide = dict(wide_selection=(64, 800), selection_distill=selection_distill,
                distill_answers=distill_answers)
    nsa_start = [] if not compress_norm else [Stage("nsa-2k", replace(bundled, model=nsa_model))]
    nsa_from = "nsa-tiny" if not compress_norm else str(Path(out) / "nsa-2k" / "checkpoint")
    return [
        *nsa_start,
        Stage("nsa-nowindow-2k", replace(bundled, model=no_window)),
        Stage("nsa", replace(extension, init_from=nsa_from, model=nsa_long_model, **wide),
              after="nsa-2k" if compress_norm else None),
        Stage("full", replace(extension, attention="full", init_from="full-tiny")),
        Stage("nsa-nowindow", replace(extension, init_from=pretrained,
                                      model=replace(nsa_long_model, window=0), **wide),
              after="nsa-nowindow-2k"),
    ]


def foreign_stages(out: str | Path, stages: list[Stage]) -> list[str]:
    """The stage folders under `out` whose run recorded another configuration than the stage's (another
    variant of the recipe, or a recipe since changed): a finished one would otherwise count as done."""
    import json

    from nsa_eval.train.recipe import config_from_dict, load_resume_state

    foreign = []
    for stage in stages:
        folder = Path(out) / stage.name
        state = stage_state(folder)
        if state == "new":
            continue
        recorded = (json.loads((folder / "summary.json").read_text())["config"] if state == "done"
                    else load_resume_state(folder)["config"])
        if config_from_dict(recorded) != stage.config:  # fields added since take their defaults
            foreign.append(str(folder))
    return foreign


def stage_state(stage_dir: Path) -> str:
    """'done', 'partial' (a resume.pt) or 'new'."""
    if (stage_dir / "summary.json").exists():
        return "done"
    return "partial" if (stage_dir / RESUME_FILE).exists() else "new"


def run_long_recipe(out: str | Path, data_dir: str | Path, *, device: str | None = None,
                    workers: int | None = None, stop_after_minutes: float | None = None,
                    echo=print, stages: list[Stage] | None = None) -> bool:
    """Run every stage that is ready, side by side; True when all stages are done.

    `workers`: batch-building processes per stage (default: the CPUs shared among the stages that
    can run at once). `stop_after_minutes`: no stage trains past this many minutes from now.
    `stages`: the recipe's by default (the tests give small ones).
    """
    import multiprocessing
    import os

    import torch

    out = Path(out)
    stages = long_stages(out) if stages is None else stages
    if workers is None:
        workers = max(1, ((os.cpu_count() or 1) - 2) // 3)
    context = multiprocessing.get_context("spawn")  # CUDA must not be initialised in a forked child
    start = time.monotonic()
    running: dict[str, multiprocessing.process.BaseProcess] = {}
    tried: set[str] = set()
    while True:
        done = {s.name for s in stages if stage_state(out / s.name) == "done"}
        left = None if stop_after_minutes is None else stop_after_minutes - (time.monotonic() - start) / 60
        for stage in stages:
            ready = stage.after is None or stage.after in done
            if stage.name in done or stage.name in tried or not ready or (left is not None and left < 1):
                continue
            resume = stage_state(out / stage.name) == "partial"
            echo(f"{stage.name}: {'resuming' if resume else 'starting'} ({stage.config.attention}, "
                 f"{stage.config.seq_len} tokens, init {stage.config.init_from or 'random'})")
            process = context.Process(target=_train_stage, args=(stage, str(out / stage.name), str(data_dir),
                                                                 device, workers, left, resume,
                                                                 torch.get_num_threads()))
            process.start()
            running[stage.name], tried = process, tried | {stage.name}
        if not running:
            break
        time.sleep(2)
        for name, process in list(running.items()):
            if not process.is_alive():
                process.join()
                del running[name]
                if process.exitcode != 0:
                    echo(f"{name}: failed (exit code {process.exitcode})")
    states = {s.name: stage_state(out / s.name) for s in stages}
    echo("stages: " + ", ".join(f"{name} {state}" for name, state in states.items()))
    finished = all(state == "done" for state in states.values())
    if finished:
        from nsa_eval.train.plots import plot_runs

        plot_runs([out / s.name for s in stages if s.after is not None or s.config.init_from is not None],
                  out / "loss_curves.png")
    return finished


def _train_stage(stage: Stage, stage_dir: str, data_dir: str, device, workers: int, minutes, resume: bool,
                 threads: int):
    """A child process: one stage's `train` call, its lines prefixed by the stage's name. It takes the
    parent's CPU thread count, on which a CPU run's arithmetic (and so a resumed run's bits) depends."""
    import torch

    from nsa_eval.train.data import load_corpus
    from nsa_eval.train.recipe import train

    torch.set_num_threads(threads)
    train(stage.config, load_corpus(data_dir), stage_dir, device=device, workers=workers,
          echo=lambda line: print(f"{stage.name}: {line}", flush=True), stop_after_minutes=minutes,
          resume=resume)

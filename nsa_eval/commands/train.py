"""`nsa-eval train`: train one model of the nsa-tiny / full-tiny pair (docs/training.md).

    nsa-eval train --attention nsa --out runs/train/nsa --seed 0 --minutes 4
    nsa-eval train --attention full --out runs/train/full --seed 0 --match runs/train/nsa
    nsa-eval train --attention both --out runs/train --seed 0 --minutes 4   # the two above
    nsa-eval train --attention nsa --out /tmp/t --tiny          # a few CPU steps
    nsa-eval train --attention nsa --out runs/n --steps 9000 --stop-after-minutes 8   # a first part
    nsa-eval train --attention nsa --out runs/n --resume --stop-after-minutes 8       # the next
    nsa-eval train --recipe long --selection-distill 1 --distill-answers 1 --far-needles 0.25 --out runs/long
    nsa-eval train --recipe long --out runs/long-paper    # the long pair with the paper's loss alone
    nsa-eval train --recipe long --compress-norm --out runs/long-cnorm    # its NSA with normed keys

`--match RUN` copies the step count, batch, sequence length, learning rate and retrieval mix of an
earlier run, so both models see identical tokens. `--attention both` trains NSA into <out>/nsa
(sized by --minutes or --steps), then full attention into <out>/full matched to it, and plots both
into <out>/loss_curves.png. `--recipe long` trains the long-context pair and its window ablation
(nsa_eval/train/long_context.py); run it again to continue.
The corpus and tokenizer are built into `--data` on first use (a few minutes) and reused afterwards.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from nsa_eval.errors import UsageError

DEFAULT_DATA = ".cache/nsa-train"


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the NSA or the full-attention model of the bundled pair",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=["nsa", "full", "both"], help="the model to train (or --recipe)")
    p.add_argument("--recipe", choices=["long"], help="a multi-stage recipe: 'long' = nsa-long, full-long "
                   "and nsa-long-nowindow at 16,384 tokens (docs/training.md); rerun to resume")
    p.add_argument("--out", required=True, help="run directory (logs, summary.json, checkpoint/)")
    p.add_argument("--seed", type=int, default=0)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--minutes", type=float, help="wall-clock budget; steps fixed from the measured speed")
    size.add_argument("--steps", type=int, help="number of optimiser steps")
    size.add_argument("--match", help="run directory whose steps, batch size and sequence length to copy")
    p.add_argument("--data", default=None, help=f"corpus + tokenizer directory (default {DEFAULT_DATA}, "
                                                 "or <out>/../data-tiny with --tiny)")
    p.add_argument("--corpus-sources", nargs="+", metavar="SRC",
                   help="where the text corpus comes from when --data is built: 'stdlib' and installed "
                        "packages, e.g. stdlib numpy torch (default: stdlib numpy)")
    p.add_argument("--tiny", action="store_true", help="the small CPU configuration of the tests")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--distractors", type=int, metavar="N",
                   help="needles of other keys in each training retrieval sample (default 0)")
    p.add_argument("--head-dim", type=int, help="attention head dimension of both models (default 32)")
    p.add_argument("--kv-heads", type=int, help="key/value heads of both models; divides the 8 query heads "
                                                 "(default 4: GQA groups of 2)")
    p.add_argument("--layers", type=int, help="decoder layers of both models (default 6)")
    p.add_argument("--num-selected", type=int, help="NSA selection blocks per query, forced ones included")
    p.add_argument("--window", type=int, help="NSA sliding-window length in tokens (0: no window branch)")
    p.add_argument("--compress-norm", action="store_true", default=None,
                   help="NSA: an RMSNorm over the compressed keys, bounding the compression logits "
                        "(not in the paper; docs/training.md)")
    p.add_argument("--selection-distill", type=float, metavar="W",
                   help="NSA: add W x the KL divergence from dense attention's mass per selection block to "
                        "the compressed keys' block importance to the loss (not in the paper; "
                        "docs/training.md; default 0)")
    p.add_argument("--distill-answers", type=float, metavar="A",
                   help="NSA: add A x the same divergence at each retrieval row's answer queries, the "
                        "positions that must find the needle (not in the paper; docs/training.md; default 0)")
    p.add_argument("--retrieval-lengths", type=int, nargs="+", metavar="TOKENS",
                   help="NIAH context lengths of the retrieval rows (default: the recipe's)")
    p.add_argument("--retrieval-fraction", type=float, metavar="F",
                   help="share of each batch's rows that hold retrieval samples, 0 < F <= 1 (default 0.5)")
    p.add_argument("--far-needles", type=float, metavar="F",
                   help="share of retrieval rows that open with a far needle (the longest retrieval length, "
                        "the needle in its first quarter), 0 <= F <= 1 (not in the paper; docs/training.md; "
                        "default 0)")
    p.add_argument("--workers", type=int, default=None, help="batch-building processes (default: CPUs - 2)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--kernel-impl", choices=["auto", "reference", "triton"], default="auto",
                   help="NSA kernels for training (auto: Triton on CUDA); the checkpoint says auto")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    p.add_argument("--stop-after-minutes", type=float, metavar="M",
                   help="save the state and stop after M minutes of this process (continue with --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue the unfinished run saved in --out (its configuration, not the flags')")
    p.set_defaults(handler=run_train)


def run_train(args) -> int:
    if args.recipe is not None:
        return _run_recipe(args)
    if args.attention is None:
        raise UsageError("give --attention nsa|full|both, or --recipe long")
    cfg, data_dir = _validated_config(args)
    sources = _corpus_sources(args, data_dir)
    import os

    from nsa_eval.train.data import build_corpus, corpus_exists, load_corpus
    from nsa_eval.train.recipe import RESUME_FILE, train

    if corpus_exists(data_dir):
        corpus = load_corpus(data_dir)
    else:
        print(f"building the corpus and tokenizer in {data_dir} from {', '.join(sources)}")
        corpus = (build_corpus(data_dir, sources=sources, vocab_size=512, max_files=8) if args.tiny
                  else build_corpus(data_dir, sources=sources))
    if args.match is not None:
        _check_same_corpus(corpus, Path(args.match))
    workers = args.workers if args.workers is not None else max(0, min(12, (os.cpu_count() or 1) - 2))
    workers = 0 if args.tiny else workers
    if args.attention != "both":
        if args.overwrite:
            (Path(args.out) / RESUME_FILE).unlink(missing_ok=True)
        _report(train(cfg, corpus, args.out, device=args.device, workers=workers,
                      stop_after_minutes=args.stop_after_minutes, resume=args.resume), args.out)
        return 0
    from dataclasses import replace

    from nsa_eval.train.plots import plot_runs

    out = Path(args.out)
    first = train(replace(cfg, attention="nsa"), corpus, out / "nsa", device=args.device, workers=workers)
    _report(first, out / "nsa")
    matched = replace(cfg, attention="full", steps=first["steps"], minutes=None, selection_distill=0.0,
                      distill_answers=0.0)
    _report(train(matched, corpus, out / "full", device=args.device, workers=workers), out / "full")
    plot_runs([out / "nsa", out / "full"], out / "loss_curves.png")
    return 0


def _run_recipe(args) -> int:
    """`--recipe long`: the stages of nsa_eval/train/long_context.py, resumed where they stopped."""
    # the flags that choose a variant of the recipe
    recipe_flags = ("compress_norm", "selection_distill", "distill_answers", "far_needles")
    given = [f"--{f.replace('_', '-')}" for f in ("attention", *CONFIG_FLAGS, "corpus_sources")
             if f not in recipe_flags and getattr(args, f) not in (None, False)]
    given += [flag for flag, on in (("--tiny", args.tiny), ("--resume", args.resume),
                                    ("--overwrite", args.overwrite)) if on]
    if given:
        raise UsageError(f"--recipe {args.recipe} fixes its own configuration and resumes by itself: drop "
                         f"{', '.join(given)}")
    if args.stop_after_minutes is not None and args.stop_after_minutes <= 0:
        raise UsageError(f"--stop-after-minutes must be > 0, got {args.stop_after_minutes}")
    if args.kernel_impl != "auto" or args.seed != 0:
        raise UsageError("--recipe continues the bundled pair (seed 0, the default kernels): drop --seed "
                         "and --kernel-impl")
    from nsa_eval.models.loading import resolve_checkpoint
    from nsa_eval.train.data import build_corpus, corpus_exists, corpus_manifest
    from nsa_eval.train.long_context import foreign_stages, long_stages, run_long_recipe

    distill = _distill_weight(args, "nsa")
    answers = _distill_weight(args, "nsa", "distill_answers")
    far = _far_needles(args)
    stages = long_stages(args.out, compress_norm=bool(args.compress_norm), selection_distill=distill,
                         distill_answers=answers, far_needles=far)
    foreign = foreign_stages(args.out, stages)
    if foreign:
        variant = [flag for flag, on in (("--compress-norm", args.compress_norm),
                                         (f"--selection-distill {distill:g}", distill),
                                         (f"--distill-answers {answers:g}", answers),
                                         (f"--far-needles {far:g}", far)) if on]
        raise UsageError(f"--out {args.out} holds stages of another configuration ({', '.join(foreign)}): "
                         f"expected this recipe's{' with ' + ' '.join(variant) if variant else ''}; "
                         "give another --out (each variant of the recipe has its own)")
    data_dir = Path(args.data or DEFAULT_DATA)
    if not corpus_exists(data_dir):
        print(f"building the corpus and tokenizer in {data_dir}")
        build_corpus(data_dir)
    bundled = json.loads((Path(resolve_checkpoint("nsa-tiny")) / "training.json").read_text())["corpus"]
    if corpus_manifest(data_dir).get("sha256") != bundled["sha256"]:
        raise UsageError(f"--data {data_dir} holds another corpus than the one nsa-tiny was trained on "
                         f"(sha256 differs; its sources and versions: {bundled['sources']}, "
                         f"{bundled['versions']}): the long models would not continue on the same data")
    finished = run_long_recipe(args.out, data_dir, device=args.device, workers=args.workers,
                               stop_after_minutes=args.stop_after_minutes, stages=stages)
    if not finished:
        print(f"unfinished: run the same command again to continue ({args.out})", flush=True)
    return 0


def _report(summary: dict, out) -> None:
    if not summary.get("finished", True):
        print(f"unfinished: {summary['attention']} at step {summary['step']}/{summary['steps']}; continue "
              f"with the same --out and --resume", flush=True)
        return
    ev = summary["final_eval"]
    print(f"done: {summary['attention']} {summary['steps']} steps, {summary['tokens']:,} tokens in "
          f"{summary['seconds']} s; held-out loss {ev['heldout_loss']:.4f}, NIAH probe "
          f"{ev['probe_exact_match']:.2f}; checkpoint {Path(out) / 'checkpoint'}", flush=True)


def _validated_config(args):
    """TrainConfig and data directory from the flags; UsageError before any work starts."""
    from dataclasses import replace

    from nsa_eval.train.recipe import TrainConfig, tiny_config

    out = Path(args.out)
    if args.attention == "both" and args.match is not None:
        raise UsageError("--attention both sizes the full run itself: drop --match")
    if args.attention == "both" and (args.resume or args.stop_after_minutes is not None):
        raise UsageError("--resume and --stop-after-minutes need one model per run: use --attention nsa, "
                         "then --attention full --match")
    if args.stop_after_minutes is not None and args.stop_after_minutes <= 0:
        raise UsageError(f"--stop-after-minutes must be > 0, got {args.stop_after_minutes}")
    if args.resume:
        return _resumed_config(args, out)
    if (out / "resume.pt").exists() and not args.overwrite:
        raise UsageError(f"--out {out} holds an unfinished run: pass --resume to continue it or --overwrite "
                         "to start again")
    done = [out / "summary.json"] if args.attention != "both" else [out / "nsa" / "summary.json"]
    if any(p.exists() for p in done) and not args.overwrite:
        raise UsageError(f"--out {out} already holds a finished run (pass --overwrite to replace it)")
    attention = "nsa" if args.attention == "both" else args.attention
    cfg = tiny_config(attention) if args.tiny else TrainConfig(attention=attention)
    cfg = replace(cfg, seed=args.seed, model=replace(cfg.model, kernel_impl=args.kernel_impl))
    if args.minutes is not None:
        if args.minutes <= 0:
            raise UsageError(f"--minutes must be > 0, got {args.minutes}")
        cfg = replace(cfg, minutes=args.minutes, steps=None)
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {args.steps}")
        cfg = replace(cfg, steps=args.steps, minutes=None)
    for flag, field in (("batch_size", "batch_size"), ("seq_len", "seq_len"), ("lr", "lr")):
        value = getattr(args, flag)
        if value is not None:
            if value <= 0:
                raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
            cfg = replace(cfg, **{field: value})
    if args.num_selected is not None and args.num_selected < 3:
        raise UsageError(f"--num-selected must be >= 3 (1 initial + 2 local blocks), got {args.num_selected}")
    if args.window is not None and args.window < 0:
        raise UsageError(f"--window must be >= 0 (0: no sliding-window branch), got {args.window}")
    if args.head_dim is not None and (args.head_dim < 16 or args.head_dim % 16):
        raise UsageError(f"--head-dim must be a multiple of 16 (the kernels' tile), got {args.head_dim}")
    heads = cfg.model.num_heads
    if args.kv_heads is not None and (args.kv_heads < 1 or heads % args.kv_heads):
        raise UsageError(f"--kv-heads must divide the {heads} query heads, got {args.kv_heads}")
    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    for flag, field in (("head_dim", "head_dim"), ("num_selected", "num_selected"), ("window", "window"),
                        ("kv_heads", "num_kv_heads"), ("layers", "num_layers")):
        if getattr(args, flag) is not None:
            cfg = replace(cfg, model=replace(cfg.model, **{field: getattr(args, flag)}))
    if args.compress_norm:
        cfg = replace(cfg, model=replace(cfg.model, compress_norm=True))
    for name in ("selection_distill", "distill_answers"):
        if getattr(args, name) is not None:
            cfg = replace(cfg, **{name: _distill_weight(args, args.attention, name)})
    if args.retrieval_lengths:
        cfg = replace(cfg, mix=replace(cfg.mix, retrieval_lengths=_retrieval_lengths(args, cfg)))
    if args.retrieval_fraction is not None:
        if not 0 < args.retrieval_fraction <= 1:
            raise UsageError(f"--retrieval-fraction must be in (0, 1], got {args.retrieval_fraction}")
        cfg = replace(cfg, mix=replace(cfg.mix, retrieval_fraction=args.retrieval_fraction))
    if args.far_needles is not None:
        cfg = replace(cfg, mix=replace(cfg.mix, far_needles=_far_needles(args)))
    if args.distractors is not None:
        from nsa_eval.tasks.niah import NEEDLE_KEYS

        if not 0 <= args.distractors < len(NEEDLE_KEYS):
            raise UsageError(f"--distractors must be in [0, {len(NEEDLE_KEYS) - 1}], got {args.distractors}")
        cfg = replace(cfg, mix=replace(cfg.mix, distractors=args.distractors))
    if args.match is not None:
        shape = [f"--{f.replace('_', '-')}" for f in ("head_dim", "kv_heads", "layers") if getattr(args, f)]
        if shape:
            raise UsageError(f"--match copies the model's shape from {args.match}: drop {', '.join(shape)}")
        cfg = _matched(cfg, Path(args.match))
    if cfg.steps is None and cfg.minutes is None:
        raise UsageError("give one of --minutes, --steps or --match (or --tiny)")
    return cfg, _data_dir(args, out)


CONFIG_FLAGS = ("steps", "minutes", "match", "batch_size", "seq_len", "lr", "retrieval_lengths",
                "retrieval_fraction", "distractors", "head_dim", "kv_heads", "layers", "num_selected",
                "window", "compress_norm", "selection_distill", "distill_answers", "far_needles")


def _distill_weight(args, attention: str, name: str = "selection_distill") -> float:
    """The weight of `--selection-distill` or (`name`) `--distill-answers` (0 when not given): >= 0, and
    above 0 for NSA only (with `--attention both`, its NSA run)."""
    flag = "--" + name.replace("_", "-")
    given = getattr(args, name)
    weight = 0.0 if given is None else given
    if not (weight >= 0 and math.isfinite(weight)):
        raise UsageError(f"{flag} must be a finite weight >= 0, got {given}")
    if weight and attention == "full":
        raise UsageError(f"{flag} trains NSA's block selection: full attention has none")
    return weight


def _far_needles(args) -> float:
    """`--far-needles` (0 when not given), a share in [0, 1]."""
    share = 0.0 if args.far_needles is None else args.far_needles
    if not 0 <= share <= 1:
        raise UsageError(f"--far-needles must be a share in [0, 1], got {args.far_needles}")
    return share


def _resumed_config(args, out: Path):
    """The configuration saved in an unfinished run; its flags may not be given again."""
    from nsa_eval.train.recipe import config_from_dict, load_resume_state

    given = [f"--{f.replace('_', '-')}" for f in CONFIG_FLAGS if getattr(args, f) is not None]
    if args.overwrite:
        given.append("--overwrite")
    if given:
        raise UsageError(f"--resume continues the saved configuration: drop {', '.join(given)}")
    if (out / "summary.json").exists():
        raise UsageError(f"--out {out} holds a finished run: nothing to resume")
    try:
        saved = load_resume_state(out)
    except FileNotFoundError:
        raise UsageError(f"--resume: no unfinished run in {out} (expected {out / 'resume.pt'})") from None
    cfg = config_from_dict(saved["config"])
    if cfg.attention != args.attention:
        raise UsageError(f"--resume: {out} holds a {cfg.attention} run, not --attention {args.attention}")
    return cfg, _data_dir(args, out)


def _corpus_sources(args, data_dir: Path) -> tuple[str, ...]:
    """The corpus sources to build from; a UsageError when --corpus-sources cannot be honoured."""
    from nsa_eval.train.data import DEFAULT_SOURCES, corpus_exists, corpus_manifest, source_root

    if args.corpus_sources is None:
        return DEFAULT_SOURCES
    sources = tuple(dict.fromkeys(args.corpus_sources))
    if corpus_exists(data_dir):
        built = tuple(corpus_manifest(data_dir)["sources"])
        if built != sources:
            raise UsageError(f"--corpus-sources {' '.join(sources)}: --data {data_dir} already holds a "
                             f"corpus of {' '.join(built)}; give another --data to build a new one")
        return sources
    for source in sources:
        try:
            source_root(source)
        except ValueError as err:
            raise UsageError(f"--corpus-sources: {err}") from None
    return sources


def _check_same_corpus(corpus, run_dir: Path) -> None:
    theirs = json.loads((run_dir / "summary.json").read_text()).get("corpus", {}).get("sha256")
    if theirs is not None and theirs != corpus.manifest.get("sha256"):
        raise UsageError(f"--match {run_dir} was trained on another corpus (its sha256 differs from "
                         "--data's): the data would differ")


def _data_dir(args, out: Path) -> Path:
    if args.data:
        return Path(args.data)
    return out.parent / "data-tiny" if args.tiny else Path(DEFAULT_DATA)


def _retrieval_lengths(args, cfg) -> tuple[int, ...]:
    lengths = tuple(sorted(set(args.retrieval_lengths)))
    from nsa_eval.train.data import RETRIEVAL_MARGIN as margin

    bad = [n for n in lengths if n < 64 or n + margin > cfg.seq_len + 1]
    if bad:
        raise UsageError(f"--retrieval-lengths {bad[0]}: each length must be >= 64 and fit a "
                         f"{cfg.seq_len}-token row with {margin} tokens to spare")
    return lengths


def _matched(cfg, run_dir: Path):
    from dataclasses import replace

    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise UsageError(f"--match {run_dir}: no summary.json (is it a finished training run?)")
    theirs = json.loads(summary_path.read_text())["config"]
    if theirs["seed"] != cfg.seed:
        raise UsageError(f"--match {run_dir} used --seed {theirs['seed']}, not {cfg.seed}: "
                         "the data would differ")
    mix = replace(cfg.mix, **{k: tuple(v) if isinstance(v, list) else v for k, v in theirs["mix"].items()})
    # the shape both models share (the NSA-only fields and the kernels stay this run's)
    model = replace(cfg.model, **{k: theirs["model"][k] for k in SHARED_SHAPE if k in theirs["model"]})
    return replace(cfg, steps=theirs["steps"], minutes=None, batch_size=theirs["batch_size"],
                   seq_len=theirs["seq_len"], lr=theirs["lr"], mix=mix, model=model)


SHARED_SHAPE = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                "max_position_embeddings", "rope_theta", "tie_word_embeddings")

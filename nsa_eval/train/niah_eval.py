"""NIAH accuracy of a trained checkpoint over a (context length x depth) grid, and its heatmap.

Prompts come from the evaluation's own generator, `nsa_eval.tasks.niah.make_niah_doc` (seeds
`seed * 1000 + sample`, as its lm-eval task uses; training used seeds >= 1e9).
Two scorers, both counting a hit when the 7-digit value is what greedy decoding would emit:

- "teacher": one forward pass over prompt + " <value>"; a hit when the argmax at every answer position
  is the value's next token and the argmax after the last digit is not a digit. This equals greedy
  decoding followed by the task's whole-number match whenever the model answers right after the
  prefix (which is what it was trained to do), and needs no decode path: the GPU run uses it.
- "generate": `model.generate` (greedy, 12 new tokens) scored with the task's `needle_found`.

    python -m nsa_eval.train.niah_eval CHECKPOINT --out reports/training/niah_nsa.json --png ...
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

WITHIN = (512, 1024, 1536, 2048)  # within the 2,048-token training length
BEYOND = (3072, 4096)
DEPTHS = tuple(round(100 * i / 9, 2) for i in range(10))


def score_doc(model, tokenizer, doc: dict, mode: str = "teacher", device: str = "cpu") -> dict:
    """{"prediction": str, "score": 0/1} for one NIAH doc (keys of make_niah_doc)."""
    import torch

    from nsa_eval.tasks.niah import needle_found

    prompt = tokenizer(doc["prompt"], add_special_tokens=False)["input_ids"]
    if mode == "generate":
        ids = torch.tensor([prompt], device=device)  # [1, L]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, len(prompt) :])
        return {"prediction": text, "score": float(needle_found(text, doc["answer"]))}
    answer = tokenizer(" " + doc["answer"], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + answer], device=device)  # [1, L + A]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :]  # [A + 1, V]
    predicted = logits.argmax(-1).tolist()  # [A + 1]
    right = 0
    while right < len(answer) and predicted[right] == answer[right]:
        right += 1
    after_is_digit = tokenizer.decode(predicted[-1:]).strip()[:1].isdigit()
    hit = right == len(answer) and not after_is_digit
    shown = tokenizer.decode(answer[:right] + predicted[right : right + 1])
    return {"prediction": shown, "score": float(hit)}


def build_docs(tokenizer, lengths=WITHIN + BEYOND, depths=DEPTHS, samples: int = 2, seed: int = 0,
               progress: bool = True) -> list[dict]:
    """make_niah_doc for every (length, depth, sample), lengths outermost; seeds seed * 1000 + sample."""
    from tqdm.auto import tqdm

    from nsa_eval.tasks.niah import make_niah_doc

    cells = [(n, d, s) for n in lengths for d in depths for s in range(samples)]
    docs = []
    for n, d, s in tqdm(cells, desc="NIAH prompts", disable=not progress):
        for retry in range(8):  # make_niah_doc cannot size some (seed, cell) pairs exactly: next seed
            try:
                docs.append({**make_niah_doc(tokenizer, n, d, seed * 1000 + s + 100 * retry), "sample": s})
                break
            except RuntimeError:
                continue
    return docs


def score_docs(model, tokenizer, docs: list[dict], mode: str = "teacher", device: str = "cpu",
               progress: bool = True) -> list[dict]:
    """One row per doc: context_length, depth_percent, sample, answer, prediction, score."""
    from tqdm.auto import tqdm

    model.eval()
    rows = []
    for doc in tqdm(docs, desc=f"NIAH {mode}", disable=not progress):
        result = score_doc(model, tokenizer, doc, mode, device)
        rows.append({k: doc[k] for k in ("context_length", "depth_percent", "sample", "answer")} | result)
    return rows


def accuracy(rows: list[dict], max_length: int | None = None) -> float | None:
    """Mean score of the rows up to max_length tokens; None when there are none."""
    scores = [r["score"] for r in rows if max_length is None or r["context_length"] <= max_length]
    return float(np.mean(scores)) if scores else None


def plot_heatmap(rows: list[dict], path: str | Path, title: str) -> None:
    """Mean score per (depth, length) cell as a red-green heatmap, cells annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["context_length"] for r in rows})
    depths = sorted({r["depth_percent"] for r in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            cell = [r["score"] for r in rows if r["depth_percent"] == d and r["context_length"] == n]
            grid[i, j] = np.mean(cell) if cell else np.nan
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(lengths), 4.2))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(rows: list[dict], within: int) -> dict:
    lengths = sorted({r["context_length"] for r in rows})
    return {
        "accuracy_within": accuracy(rows, within),
        "accuracy_beyond": accuracy([r for r in rows if r["context_length"] > within]),
        "accuracy_by_length": {n: accuracy([r for r in rows if r["context_length"] == n]) for n in lengths},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="checkpoint dirs sharing one tokenizer (same prompts)")
    p.add_argument("--out", required=True, help="JSON: per checkpoint, the rows and accuracies")
    p.add_argument("--png-dir", help="write niah_<name>.png heatmaps here (name = checkpoint's parent dir)")
    p.add_argument("--lengths", default=",".join(map(str, WITHIN + BEYOND)))
    p.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--mode", choices=["teacher", "generate"], default="teacher")
    p.add_argument("--device", default=None)
    p.add_argument("--within", type=int, default=2048, help="training length, for the 'within' accuracy")
    p.add_argument("--methods", default="", help="comma list of nsa_eval.methods to apply to Llama "
                   "checkpoints (e.g. sink_window,topk,quest,h2o); empty: the checkpoints as they are")
    p.add_argument("--budget", type=int, default=896,
                   help="keys per query for --methods, sink and local included (896: NSA-tiny's count "
                   "for the last query of a 2,048-token context)")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--local", type=int, default=256)
    args = p.parse_args(argv)

    import torch

    from nsa_eval.train.recipe import load_checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lengths = [int(x) for x in args.lengths.split(",")]
    docs, results = None, {}
    if args.png_dir:
        Path(args.png_dir).mkdir(parents=True, exist_ok=True)
    runs = [(c, m) for c in args.checkpoints for m in (args.methods.split(",") if args.methods else [None])]
    for checkpoint, method in runs:
        model, tokenizer = load_checkpoint(checkpoint, dtype=torch.bfloat16 if device == "cuda" else None)
        model.to(device)
        path = Path(checkpoint).resolve()
        name = path.parent.name if path.name == "checkpoint" else path.name
        extra = {}
        if method:
            from nsa_eval.methods import apply_attention

            apply_attention(model, method, budget=args.budget, sink=args.sink, local=args.local,
                            sparse_prefill=True)
            name = f"{name}+{method}"
            extra = {"method": method, "budget": args.budget, "sink": args.sink, "local": args.local,
                     "sparse_prefill": True}
        depths = [float(x) for x in args.depths.split(",")]
        docs = docs or build_docs(tokenizer, lengths, depths, samples=args.samples)
        start = time.perf_counter()
        rows = score_docs(model, tokenizer, docs, args.mode, device)
        results[name] = {"checkpoint": str(checkpoint), "mode": args.mode, "device": device, **extra,
                         "seconds": round(time.perf_counter() - start, 1), **summarize(rows, args.within),
                         "rows": rows}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "rows"}), flush=True)
        if args.png_dir:
            plot_heatmap(rows, Path(args.png_dir) / f"niah_{name}.png",
                         f"NIAH ({args.mode}, {device}): {name}, training length {args.within}")
        Path(args.out).write_text(json.dumps(results, indent=1))  # after each grid: a stopped run keeps it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

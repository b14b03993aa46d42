"""Which blocks does an NSA checkpoint select while it answers a NIAH prompt?

    python scripts/trace_niah_selection.py --checkpoint nsa-tiny --lengths 1536 2048 \
        --out reports/training/selection_trace.json

For every prompt of the teacher-forced NIAH grid (nsa_eval.train.niah_eval: the task's own
make_niah_doc prompts, the true answer fed after the prompt) and every answer token, it records
whether the model predicts the token and in how many of the (layer, KV head) pairs the selection
branch picked every selection block holding the needle's digits. Runs the reference kernels on the
CPU (float32), or the Triton ones with --device cuda. Prints one line per prompt and a summary:
how often a digit is right given how many pairs selected the needle.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def trace_doc(model, tokenizer, doc: dict, device: str) -> dict:
    """Per answer token: right or wrong, and how many (layer, KV head) pairs selected the needle."""
    import torch

    prompt = tokenizer(doc["prompt"], add_special_tokens=False)["input_ids"]
    answer = tokenizer(" " + doc["answer"], add_special_tokens=False)["input_ids"]
    digits = tokenizer(doc["answer"], add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(prompt)) if prompt[i : i + len(digits)] == digits)
    select_size = model.config.select_size
    needle_blocks = sorted({p // select_size for p in range(start, start + len(digits))})

    with torch.no_grad(), model.recording_selections() as recorded:
        ids = torch.tensor([prompt + answer], device=device)  # [1, L + A]
        logits = model(input_ids=ids, use_cache=False).logits[0]  # [L + A, V]
    selections = [layer[0][0].cpu() for layer in recorded]  # one int [T, Hkv, n] per layer
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()  # [A]
    pairs = len(selections) * selections[0].shape[1]
    covered = []
    for i in range(len(answer)):
        t = len(prompt) - 1 + i  # the query that predicts answer token i
        covered.append(sum(all(b in set(layer[t, h].tolist()) for b in needle_blocks)
                           for layer in selections for h in range(layer.shape[1])))
    right = [int(p == a) for p, a in zip(predicted, answer, strict=True)]
    is_digit = [tokenizer.decode([a]).strip().isdigit() for a in answer]
    return {"context_length": doc["context_length"], "depth_percent": doc["depth_percent"],
            "sample": doc["sample"], "needle_start": start, "needle_blocks": needle_blocks, "pairs": pairs,
            "right": right, "is_digit": is_digit, "pairs_selecting_needle": covered}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="nsa-tiny", help="an NSA checkpoint: short name or directory")
    p.add_argument("--lengths", type=int, nargs="+", default=[1536, 2048])
    p.add_argument("--depths", type=float, nargs="+",
                   default=[0.0, 11.11, 22.22, 33.33, 44.44, 55.56, 66.67, 77.78, 88.89, 100.0])
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="write every prompt's trace here (JSON)")
    args = p.parse_args(argv)

    import torch

    from nsa_eval.models.loading import load_pretrained
    from nsa_eval.train.niah_eval import build_docs

    model, tokenizer = load_pretrained(args.checkpoint, device=args.device,
                                       dtype="bfloat16" if args.device.startswith("cuda") else "float32")
    if not hasattr(model.config, "select_size"):
        p.error(f"--checkpoint {args.checkpoint}: not an NSA model (no select_size in its config)")
    torch.set_grad_enabled(False)
    model.eval()
    rows = []
    for doc in build_docs(tokenizer, args.lengths, args.depths, samples=args.samples):
        row = trace_doc(model, tokenizer, doc, args.device)
        rows.append(row)
        print(f"{row['context_length']:5d} depth {row['depth_percent']:6.2f} #{row['sample']} "
              f"needle block(s) {row['needle_blocks']}: right {row['right']} pairs selecting it "
              f"(of {row['pairs']}) "
              f"{row['pairs_selecting_needle']}", flush=True)
    by_cover = defaultdict(lambda: [0, 0])  # pairs selecting the needle -> [right, tokens]
    for row in rows:
        tokens = zip(row["right"], row["pairs_selecting_needle"], row["is_digit"], strict=True)
        for ok, cover, digit in tokens:
            if not digit:
                continue
            by_cover[cover][0] += ok
            by_cover[cover][1] += 1
    print("digit tokens right, by the number of (layer, KV head) pairs that selected the needle:")
    for cover in sorted(by_cover):
        right, total = by_cover[cover]
        print(f"  {cover:2d} pairs: {right}/{total} right ({right / total:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps({"checkpoint": args.checkpoint, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

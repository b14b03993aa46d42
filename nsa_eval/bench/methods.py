"""Time one prefill per attention method and print its statistics.

    python -m nsa_eval.bench.methods --length 4096 --methods full,sink_window,topk,quest,h2o

`--model` is a Hugging Face directory (default: the offline SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: offline SmolLM2-135M)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--methods", default="full,sink_window,topk,quest,h2o")
    parser.add_argument("--budget", type=int, default=2560)
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--local", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from nsa_eval.methods import METHODS, apply_attention, attention_stats
    from nsa_eval.models.smollm2 import smollm2_path

    methods = args.methods.split(",")
    for name in methods:
        METHODS.get(name)  # fail on a typo before loading anything
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, args.length), generator=generator)
    ids = ids.to(args.device)
    for name in methods:
        apply_attention(model, name, budget=args.budget, sink=args.sink, local=args.local)
        with torch.no_grad():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids, use_cache=False)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        stats = attention_stats(model)
        print(
            f"{name:12s} T={args.length} prefill {seconds:7.2f} s  keys/query mean {stats['mean']:7.1f} "
            f"max {stats['max']:5d}  KV read/KV head mean {stats['kv_read_mean']:7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

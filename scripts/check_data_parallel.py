"""Check that N data-parallel processes (accelerate) give the same lm-eval results as one.

Runs the NIAH grid through the `nsa-eval` lm-eval model once in a single process, then under
`accelerate launch --multi_gpu --num_processes N`, and compares scores and activated-token
statistics. On a GPU host each process takes one GPU (NCCL); on a CPU host the processes talk over
gloo. Exit code 0 when both runs agree, 1 when they differ.

    python scripts/check_data_parallel.py --pretrained nsa-tiny --attention nsa --processes 2 --device cuda
    python scripts/check_data_parallel.py --pretrained full-tiny --attention topk --budget 512 \\
        --sink 64 --local 128 --processes 2 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrained", default="nsa-tiny")
    parser.add_argument("--attention", default="nsa")
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--sink", type=int, default=None)
    parser.add_argument("--local", type=int, default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100])
    parser.add_argument("--samples-per-cell", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("runs/data_parallel_check"))
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_args(args) -> str:
    pairs = {"pretrained": args.pretrained, "attention": args.attention, "batch_size": 1}
    for key in ("budget", "sink", "local"):
        if getattr(args, key) is not None:
            pairs[key] = getattr(args, key)
    return ",".join(f"{k}={v}" for k, v in pairs.items())


def evaluate(args) -> None:
    """One evaluation; rank 0 writes scores, per-sample hits and statistics to args.worker."""
    import lm_eval

    import nsa_eval  # noqa: F401  (registers the nsa-eval model)
    from nsa_eval.models import resolve_checkpoint
    from nsa_eval.tasks import task_manager

    metadata = {
        "tokenizer": str(resolve_checkpoint(args.pretrained)),
        "niah_lengths": args.lengths,
        "niah_depths": args.depths,
        "niah_samples_per_cell": args.samples_per_cell,
    }
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="nsa-eval", model_args=model_args(args), tasks=["nsa_niah"], device=args.device,
        bootstrap_iters=0, log_samples=True,
        task_manager=task_manager(metadata, all_lm_eval_tasks=False),
    )
    if results is None:  # ranks other than 0
        return
    samples = results["samples"]["nsa_niah"]
    hits = sorted((s["doc_id"], s["filtered_resps"][0]) for s in samples)
    stats = results["config"].get("activated_tokens", {})
    args.worker.write_text(json.dumps({
        "scores": {k: v for k, v in results["results"]["nsa_niah"].items() if k != "alias"},
        "responses": hits,
        "queries": stats.get("queries"),
        "mean": stats.get("mean"),
        "max": stats.get("max"),
        "processes": results["config"].get("data_parallel_processes", 1),
        "seconds": round(time.perf_counter() - start, 1),
    }, indent=1))


def launch(args, processes: int, out: Path) -> dict:
    worker = [*sys.argv[1:], "--worker", str(out)]
    if processes == 1:
        cmd = [sys.executable, __file__, *worker]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", __file__, *worker]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        evaluate(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    one = launch(args, 1, args.out / "one_process.json")
    many = launch(args, args.processes, args.out / f"{args.processes}_processes.json")
    same = {
        "scores": one["scores"] == many["scores"],
        "responses": one["responses"] == many["responses"],
        "queries": one["queries"] == many["queries"],
        "mean activated tokens": one["mean"] == many["mean"],
    }
    print(f"model_args: {model_args(args)}")
    print(f"1 process: {one['scores']} in {one['seconds']} s")
    print(f"{many['processes']} processes: {many['scores']} in {many['seconds']} s")
    for what, equal in same.items():
        print(f"  {what}: {'same' if equal else 'DIFFERENT'}")
    return 0 if all(same.values()) and many["processes"] == args.processes else 1


if __name__ == "__main__":
    sys.exit(main())

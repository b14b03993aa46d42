"""Two CPU processes under `accelerate launch --multi_gpu` (gloo) give the same results as one process,
and each ends its process group before exiting."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, json, os, sys


def record_process_group():  # registered first, so it runs after nsa-eval's own exit handler
    import torch.distributed as dist
    if "RANK" in os.environ:
        with open(sys.argv[3] + ".pg_at_exit." + os.environ["RANK"], "w") as f:
            f.write(str(dist.is_initialized()))


atexit.register(record_process_group)
import lm_eval
import nsa_eval  # registers nsa-eval
from lm_eval.tasks import TaskManager

model_dir, tasks_dir, out = sys.argv[1:4]
results = lm_eval.simple_evaluate(
    model="nsa-eval", model_args=f"pretrained={model_dir},attention=nsa,batch_size=1,max_length=256",
    tasks=["toy_mc", "toy_gen", "toy_ppl"], limit=2, device="cpu", bootstrap_iters=0, log_samples=False,
    task_manager=TaskManager(include_path=tasks_dir, include_defaults=False))
if results is not None:  # rank 0 only
    keep = {t: {k: v for k, v in r.items() if k != "alias"} for t, r in results["results"].items()}
    stats = results["config"]["activated_tokens"]
    json.dump({"results": keep, "queries": stats["queries"], "mean": stats["mean"],
               "world_size": results["config"]["data_parallel_processes"],
               "processes": stats.get("processes", 1)}, open(out, "w"))
"""


def run(cmd: list[str], tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not Path(sys.executable).with_name("accelerate").exists(), reason="no accelerate CLI")
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="tests the CPU (gloo) path")
def test_two_cpu_processes_match_one(tiny_nsa_dir, tasks_dir, tmp_path):
    script = tmp_path / "evaluate.py"
    script.write_text(SCRIPT)
    args = [str(tiny_nsa_dir), str(tasks_dir)]
    argv = sys.argv
    sys.argv = [str(script), *args, str(tmp_path / "one.json")]
    try:  # one process: in this one (lm-eval is already imported)
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    # On a host without GPUs, --multi_gpu starts torch.distributed processes that run on the CPU over
    # gloo; `--cpu` would start a single process.
    run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(script), *args, str(tmp_path / "two.json")],
        tmp_path)
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and two["processes"] == 2  # sharded, and stats gathered from both
    # each process destroyed its process group before the interpreter's teardown (a gloo group left
    # to it can abort the process at exit, SIGABRT)
    for rank in (0, 1):
        assert (tmp_path / f"two.json.pg_at_exit.{rank}").read_text() == "False"
    assert one["results"] == two["results"]
    # max_length=256 keeps each perplexity text in one window, so no rank computes padding windows
    assert one["queries"] == two["queries"] and one["mean"] == pytest.approx(two["mean"])

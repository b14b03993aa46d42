"""MBPP 3-shot, pass@1 by execution, without lm-eval's `mbpp/utils.py` (which contacts the hub).

lm-eval's `mbpp` task imports `evaluate.load("code_eval")` when its YAML is resolved, which fetches
the metric script from the Hugging Face hub, so the task cannot load offline. The project's
`nsa_mbpp_3shot` (general/nsa_mbpp_3shot.yaml, run through the `nsa_mbpp` group) keeps lm-eval's
prompt, target, generation settings and 3-shot examples, and scores with `pass_at_1` here:

- Few-shot examples: MBPP task_ids 2, 3 and 4 (the ones lm-eval's mbpp uses, and the MBPP paper),
  selected from the dataset's `prompt` split by `fewshot_docs`, so no benchmark row is copied here.
- `pass_at_1`: each candidate program, then the doc's test asserts, runs through
  `code_execution.execute` (a fresh temporary folder, a timeout of `TIMEOUT_S`, resource limits,
  every process it starts killed at the end). It passes only when it exits with code 0 after its
  last assert ran. The score of a doc is the fraction of its candidates that pass (with one greedy
  sample, 0 or 1), as code_eval's pass@1 estimator.
- The code is model-written and is executed: it runs only with the same opt-in as code_eval,
  the environment variable `HF_ALLOW_CODE_EVAL=1`, checked when the task is built (before any
  generation) and again before any code runs. The task keeps `unsafe_code: true`, so lm-eval also
  requires `confirm_run_unsafe_code=True` (`--confirm_run_unsafe_code`). Run it in a sandbox:
  docs/tasks.md says what the executor's guard stops and what it does not.
"""

from __future__ import annotations

from nsa_eval.errors import UsageError
from nsa_eval.tasks.code_execution import TIMEOUT_S, execute, require_code_eval_opt_in
from nsa_eval.tasks.local_task import CodeExecutionTask

FEWSHOT_TASK_IDS = (2, 3, 4)  # lm-eval's mbpp and the MBPP paper's prompt examples, in this order


MbppTask = CodeExecutionTask  # the class nsa_mbpp_3shot.yaml names


def fewshot_docs(dataset):
    """The rows with task_id 2, 3, 4 of MBPP's `prompt` split, in that order (fewshot process_docs)."""
    position = {int(task_id): i for i, task_id in enumerate(dataset["task_id"])}
    missing = [t for t in FEWSHOT_TASK_IDS if t not in position]
    if missing:
        raise UsageError(
            f"MBPP's prompt split has no rows with task_id {missing} (the 3-shot examples); "
            f"it has task_ids {sorted(position)}"
        )
    return dataset.select([position[t] for t in FEWSHOT_TASK_IDS])


def pass_at_1(references, predictions) -> float:
    """lm-eval metric: mean over docs of the fraction of candidates that pass the doc's tests.

    `references`: a doc's test code (a string) or a list of them; `predictions`: one program per
    reference, or a list of candidate programs per reference (code_eval's interface). Each program
    runs as `candidate + "\\n" + tests`, as code_eval does.
    """
    require_code_eval_opt_in()
    if isinstance(references, str):
        references = [references]
    if predictions and isinstance(predictions[0], str):
        predictions = [[p] for p in predictions]
    if len(predictions) != len(references):
        raise ValueError(f"pass_at_1: {len(references)} references but {len(predictions)} predictions")
    scores = []
    for tests, candidates in zip(references, predictions, strict=True):
        passed = [execute(candidate + "\n" + tests, TIMEOUT_S).passed for candidate in candidates]
        scores.append(sum(passed) / len(passed) if passed else 0.0)
    return sum(scores) / len(scores) if scores else 0.0

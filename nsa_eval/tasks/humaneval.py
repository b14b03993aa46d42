"""HumanEval 0-shot, pass@1 by execution, without lm-eval's `humaneval/utils.py` (which contacts the hub).

lm-eval's `humaneval` task imports `evaluate.load("code_eval")` when its YAML is resolved, which
fetches the metric script from the Hugging Face hub, so the task cannot load offline. The project's
`nsa_humaneval_0shot` (general/nsa_humaneval_0shot.yaml, run through the `nsa_humaneval` group)
keeps lm-eval's prompt (the function's signature and docstring), target (the tests and
`check(entry_point)`), greedy generation with its stop strings, and its `create_test` filter, which
puts the prompt back in front of the generated body (`build_predictions`). It scores with the
executor nsa_mbpp uses (`mbpp.pass_at_1` through `code_execution.execute`: each program in a guarded
subprocess, docs/tasks.md says what the guard stops), behind the same opt-in, HF_ALLOW_CODE_EVAL=1
and confirm_run_unsafe_code=True. Run it in a sandbox.
"""

from __future__ import annotations

from nsa_eval.tasks.local_task import CodeExecutionTask

HumanEvalTask = CodeExecutionTask  # the class nsa_humaneval_0shot.yaml names


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """lm-eval filter (`custom`): each doc's prompt followed by each of its generated bodies."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs, strict=True)]

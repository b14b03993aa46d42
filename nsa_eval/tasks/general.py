"""The NSA paper's general benchmarks (Table 1) as lm-eval groups with the shot counts pinned.

Each `nsa_<name>` group (general/*.yaml) wraps lm-eval's own task or group, overriding only
`num_fewshot` and the data loader (LocalFirstTask; `nsa_drop` also fixes its example's answer and
its stop, `nsa_eval.tasks.drop`); `nsa_mbpp` and `nsa_humaneval` wrap `nsa_mbpp_3shot` and
`nsa_humaneval_0shot`, lm-eval's mbpp and humaneval protocols with a project-local executor
(`nsa_eval.tasks.mbpp`), since lm-eval's mbpp and humaneval fetch their code_eval metric from the
Hub when they load. Which variant each one is, and which entry of
lm-eval's results holds its headline number, is recorded here and in the group's metadata, so a
report can say "MMLU 5-shot, loglikelihood" rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GeneralTask:
    """One Table 1 benchmark: the lm-eval task/group it runs and how it is scored."""

    base: str  # the task or group the nsa_ group runs (lm-eval's, or the project's nsa_mbpp_3shot)
    shots: int
    output: str  # "loglikelihood" or "generate"
    chain_of_thought: bool
    metric: str  # headline key in lm-eval's results, "<metric>,<filter>"
    paper_metric: str  # what the paper's Table 1 calls it
    unsafe_code: bool = False


GENERAL_TASKS: dict[str, GeneralTask] = {
    "nsa_mmlu": GeneralTask("mmlu", 5, "loglikelihood", False, "acc,none", "Acc"),
    "nsa_mmlu_pro": GeneralTask("mmlu_pro", 5, "generate", True, "exact_match,custom-extract", "Acc"),
    "nsa_cmmlu": GeneralTask("cmmlu", 5, "loglikelihood", False, "acc,none", "Acc"),
    "nsa_bbh": GeneralTask("bbh_cot_fewshot", 3, "generate", True, "exact_match,get-answer", "Acc"),
    "nsa_bbh_direct": GeneralTask("bbh_fewshot", 3, "generate", False, "exact_match,none", "Acc"),
    "nsa_gsm8k": GeneralTask("gsm8k_cot", 8, "generate", True, "exact_match,strict-match", "Acc"),
    "nsa_math": GeneralTask("minerva_math", 4, "generate", True, "exact_match,none", "Acc"),
    "nsa_drop": GeneralTask("drop", 1, "generate", False, "f1,none", "F1"),
    "nsa_mbpp": GeneralTask(
        "nsa_mbpp_3shot", 3, "generate", False, "pass_at_1,none", "Pass@1", unsafe_code=True
    ),
    "nsa_humaneval": GeneralTask(
        "nsa_humaneval_0shot", 0, "generate", False, "pass_at_1,create_test", "Pass@1", unsafe_code=True
    ),
}


def describe(name: str) -> str:
    """'MMLU-style' one-liner: base task, shots, variant, headline metric."""
    task = GENERAL_TASKS[name]
    cot = "chain of thought" if task.chain_of_thought else "no chain of thought"
    source = task.base if task.base.startswith("nsa_") else f"lm-eval {task.base}"
    return f"{name}: {source}, {task.shots}-shot, {task.output}, {cot}, {task.metric}"

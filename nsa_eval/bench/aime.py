"""A suite's AIME entries and the hours they take at a measured generation throughput.

An AIME entry generates `samples` answers of up to `max_gen_toks` tokens for each of `problems`
problems, so one model needs problems x samples x max_gen_toks tokens at most; at `tokens_per_s`
(sampled decoding at batch 16, the harness's throughput row) that is the projection. Every sample is
taken to run to its limit: generations that stop earlier make the real time shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

from nsa_eval.errors import UsageError

# AIME 2024 (Maxwell-Jia/AIME_2024): the 15 problems of AIME I and the 15 of AIME II
AIME_2024_PROBLEMS = 30


@dataclass(frozen=True)
class AimeEntry:
    """One AIME task entry of a suite and where its problem count came from."""

    label: str
    task: str
    problems: int
    samples: int
    max_gen_toks: int
    problems_from: str  # "limit", "data" (rows of the local test split) or "AIME 2024"

    @property
    def tokens(self) -> int:
        return self.problems * self.samples * self.max_gen_toks

    def hours(self, tokens_per_s: float) -> float:
        return self.tokens / tokens_per_s / 3600


def aime_entries_of(label: str, task: str, limit: int | None = None, gen_kwargs: dict | None = None,
                    default_max_gen_toks: int = 256) -> list[AimeEntry]:
    """A suite's AIME task entry (`label`, `task`, its `limit` and `gen_kwargs`), one AimeEntry per leaf
    task under it: the sample count (`repeats`) and `max_gen_toks` lm-eval would use (the task's YAML
    under the entry's gen_kwargs; `default_max_gen_toks` where neither gives one) and the problem
    count: `limit`, else the rows of the task's local test split, else AIME 2024's 30."""
    from lm_eval.models.utils import normalize_gen_kwargs

    from nsa_eval.tasks.index import leaf_configs
    from nsa_eval.tasks.local_data import spec_from_config

    entries = []
    for _, cfg in leaf_configs([task]):
        base = cfg.get("generation_kwargs") or {"max_gen_toks": default_max_gen_toks}
        settings = {**base, **(gen_kwargs or {})}
        try:
            max_gen_toks = normalize_gen_kwargs(settings, default_max_gen_toks)["max_gen_toks"]
        except (TypeError, ValueError) as err:
            raise UsageError(f"task entry {label}: gen_kwargs: {err}") from None
        problems, source = limit, "limit"
        if problems is None:
            problems, source = _local_rows(spec_from_config(cfg), cfg.get("test_split")), "data"
        if problems is None:
            problems, source = AIME_2024_PROBLEMS, "AIME 2024"
        samples = int(cfg.get("repeats") or 1)
        entries.append(AimeEntry(label, str(cfg.get("task", task)), int(problems), samples, int(max_gen_toks),
                                 source))
    return entries


def _local_rows(spec, split: str | None) -> int | None:
    """Rows of the task's local `split` file ($NSA_EVAL_DATA), or None where it is not on disk."""
    if spec is None or not split:
        return None
    path = spec.folder / f"{split}.jsonl"
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())

"""The report's NSA selection sweep: one NSA checkpoint at several top-n, drawn as a curve beside the
other models of each task (issue 56's `long` suite cuts nsa-long's top-n at inference)."""

from __future__ import annotations

import json
import textwrap

import pytest

from nsa_eval.report import write_report
from tests.suite_fixtures import choice_task_yaml

N_DOCS = 12
# documents each model answers right, NSA by label, the others by method: the trained top-n (8) as
# well as full attention
RIGHT = {"nsa": 12, "nsa@n4": 9, "nsa@n3": 5, "full": 12, "topk": 7}


def _stand_in(model_spec):
    """An LM answering the first RIGHT[label] documents right, with NSA's statistics for NSA."""
    from lm_eval.api.model import LM

    right = RIGHT[model_spec.label if model_spec.attention == "nsa" else model_spec.attention]
    n = model_spec.params.get("num_selected", 8)  # nsa-tiny is trained at top-n 8

    class Fixed(LM):
        def loglikelihood(self, requests):
            return [(0.0 if (int(r.args[0].split()[1]) < right) == (r.args[1].strip() == "yes") else -1.0,
                     False) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

        def attention_stats(self):
            if model_spec.attention != "nsa":
                return None
            return {"method": "nsa", "params": {"num_selected": n}, "mean": 100.0 * n, "max": 100.0 * n,
                    "queries": 10}

    return Fixed()


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory):
    from nsa_eval.runner import run_suite
    from nsa_eval.suite import load_suite

    root = tmp_path_factory.mktemp("sweep")
    (root / "tasks").mkdir()
    rows = [{"q": f"question {i}", "choices": ["yes", "no"], "label": 0} for i in range(N_DOCS)]
    (root / "tasks" / "yn.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tasks" / "yn.yaml").write_text(choice_task_yaml("sweep_yn", root / "tasks" / "yn.jsonl"))
    suite = root / "suite.yaml"
    suite.write_text(textwrap.dedent("""\
        name: sweep_test
        include_path: tasks
        defaults: {dtype: float32, sink: 16, local: 32, budget: 64}
        models:
          - {label: nsa, pretrained: nsa-tiny, attention: nsa}
          - {label: nsa@n4, pretrained: nsa-tiny, attention: nsa, params: {num_selected: 4}}
          - {label: nsa@n3, pretrained: nsa-tiny, attention: nsa, params: {num_selected: 3}}
          - {label: full, pretrained: full-tiny, attention: [full, topk]}
        tasks:
          - {task: sweep_yn, label: yn}
        """))
    run_suite(load_suite(suite), root / "run", progress=False, lm_factory=_stand_in)
    out = write_report(root / "run", root / "report", bootstrap=100)
    return out, (out / "report.md").read_text()


def test_the_sweep_is_a_curve_of_score_against_top_n(sweep_report):
    out, md = sweep_report
    assert "## NSA's selection budget" in md
    assert (out / "figures" / "selection_yn.png").stat().st_size > 0
    assert "![score vs NSA's top-n: yn](figures/selection_yn.png)" in md


def test_the_sweep_table_gives_each_top_n_its_score_and_tokens(sweep_report):
    _, md = sweep_report
    section = md.split("## NSA's selection budget", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| nsa")]
    assert rows == [f"| {label} | {n} | {100 * n} | {RIGHT[label] / N_DOCS:.3f} |"
                    for label, n in (("nsa@n3", 3), ("nsa@n4", 4), ("nsa", 8))]  # by top-n
    assert "| full" not in section  # the other models are the figure's lines, not sweep rows


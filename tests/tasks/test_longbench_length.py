"""A suite sets LongBench's own prompt length (metadata longbench_max_length): validated, in the cell's
identity, checked against the model's context, and the length the model is given."""

from __future__ import annotations

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.suite import check_suite, load_suite
from tests.suite_fixtures import make_tiny_llama

SUITE = """\
name: lb_length
defaults: {{pretrained: {model}, dtype: float32, batch_size: 1}}
models:
  - {{attention: full}}
tasks:
  - task: nsa_longbench_hotpotqa
    label: hotpotqa{metadata}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer random Llama checkpoint of 2,048 positions."""
    return make_tiny_llama(tmp_path_factory.mktemp("lb") / "model")


def _suite(tmp_path, model_dir, length=None, name="suite.yaml"):
    metadata = "" if length is None else f"\n    metadata: {{longbench_max_length: {length}}}"
    path = tmp_path / name
    path.write_text(SUITE.format(model=model_dir, metadata=metadata))
    return load_suite(path)


def test_the_length_is_in_the_cell_identity(tmp_path, model_dir):
    keys = {_suite(tmp_path, model_dir, length).cells()[0].key for length in (None, 1500, 1000)}
    assert len(keys) == 3


@pytest.mark.parametrize("value", ["0", "-5", "true", "'31500'", "[1000]"])
def test_a_bad_length_is_one_error_naming_the_key(tmp_path, model_dir, value):
    with pytest.raises(UsageError, match=r"tasks\[0\]\.metadata\.longbench_max_length: expected a positive"):
        _suite(tmp_path, model_dir, value)


def test_the_group_takes_it_and_a_misspelling_is_refused(tmp_path, model_dir):
    path = tmp_path / "group.yaml"
    path.write_text(SUITE.format(model=model_dir, metadata="\n    metadata: {longbench_max_length: 1000}")
                    .replace("nsa_longbench_hotpotqa", "nsa_longbench"))
    assert load_suite(path).tasks[0].metadata == {"longbench_max_length": 1000}
    path.write_text(path.read_text().replace("longbench_max_length", "longbench_max_len"))
    with pytest.raises(UsageError, match="unknown metadata key 'longbench_max_len'"):
        load_suite(path)


def test_validate_refuses_a_length_the_model_would_cut_again(tmp_path, model_dir):
    """hotpotqa generates up to 32 tokens: 2,016 + 32 fill the checkpoint's 2,048 positions."""
    assert check_suite(_suite(tmp_path, model_dir, 2016), check_data=False) == []
    with pytest.raises(UsageError) as err:
        check_suite(_suite(tmp_path, model_dir, 2017), check_data=False)
    assert "tasks[0] (hotpotqa) on models (entry 'full'): longbench_max_length 2017 and max_gen_toks 32 " \
           "need 2049 tokens" in str(err.value)
    assert "expected longbench_max_length up to 2016" in str(err.value)


def test_the_model_is_given_prompts_of_the_suites_length(tmp_path, model_dir, data_root, rows):
    """Through the runner: the cell's metadata reaches the task, which reads the model's tokenizer."""
    from lm_eval.api.model import LM
    from transformers import AutoTokenizer

    from nsa_eval.runner import run_suite

    context = "Passage 1:\n" + "the quick brown fox jumps over a lazy dog. " * 300
    rows.write(data_root, "Xnhyacinth/LongBench", "hotpotqa", "test",
               [{"input": "who is quick?", "context": context, "answers": ["the fox"], "length": 3000,
                 "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "x"}])
    seen = []

    class Recorder(LM):
        def generate_until(self, requests):
            seen.extend(r.args[0] for r in requests)
            return ["the fox"] * len(requests)

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for length in (None, 300):
        seen.clear()
        run_suite(_suite(tmp_path, model_dir, length, f"s{length}.yaml"), tmp_path / f"run{length}",
                  progress=False, lm_factory=lambda spec: Recorder())
        (prompt,) = seen
        tokens = len(tokenizer(prompt)["input_ids"])
        assert tokens > 2000 if length is None else tokens <= 302
        assert prompt.startswith("Answer the question based on the given passages.")
        assert prompt.endswith("Question: who is quick?\nAnswer:")

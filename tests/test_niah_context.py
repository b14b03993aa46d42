"""A NIAH prompt that would not fit its model's context is refused before any model loads.

lm-eval cuts an over-long generation prompt with only a log warning, so without this check a cell
at a model's full context (the paper's 64k grid on a 64k model, for one) silently ran a shorter,
perhaps needle-less prompt. The limits come from the checkpoints' own files (lm-eval's rule).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from nsa_eval.errors import UsageError
from nsa_eval.models.loading import context_length
from nsa_eval.suite import check_suite, load_suite
from nsa_eval.tasks.niah import framing_tokens, load_tokenizer, make_niah_doc

SUITE = """\
name: fit
models:
  - {{label: tiny, pretrained: nsa-tiny, attention: nsa{model_extra}}}
tasks:
  - task: nsa_niah
    metadata: {{niah_lengths: [1024, {longest}], niah_depths: [50]}}
    gen_kwargs: {{max_gen_toks: {answer}}}{task_extra}
"""


def check(tmp_path, longest, answer=12, model_extra="", task_extra=""):
    path = tmp_path / "fit.yaml"
    path.write_text(SUITE.format(longest=longest, answer=answer, model_extra=model_extra,
                                 task_extra=task_extra))
    return check_suite(load_suite(path), check_data=False)


def test_the_bundled_checkpoints_take_8192_tokens():
    assert context_length("nsa-tiny") == (8192, "nsa-tiny's config max_position_embeddings")
    assert context_length("full-tiny")[0] == 8192


def test_a_prompt_and_its_answer_that_fill_the_context_pass(tmp_path):
    assert framing_tokens(load_tokenizer("nsa-tiny")) == 0  # its tokenizer adds no BOS
    assert check(tmp_path, 8192 - 12) == []


def test_one_token_over_is_refused_with_what_fits(tmp_path):
    with pytest.raises(UsageError) as err:
        check(tmp_path, 8192 - 11)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'fit.yaml'}: tasks[0] (nsa_niah) on models (entry 'tiny'): "
                              "a 8181-token NIAH prompt and max_gen_toks 12 need 8193 tokens, but "
                              "nsa-tiny takes 8192 (nsa-tiny's config max_position_embeddings)")
    assert "expected niah_lengths up to 8180" in message and "\n" not in message


def test_the_task_default_answer_length_counts(tmp_path):
    """Without gen_kwargs the task's own max_gen_toks (32) is what lm-eval reserves."""
    path = tmp_path / "fit.yaml"
    path.write_text(SUITE.format(longest=8192 - 32, answer=1, model_extra="", task_extra="")
                    .replace("    gen_kwargs: {max_gen_toks: 1}\n", ""))
    assert check_suite(load_suite(path), check_data=False) == []
    path.write_text(path.read_text().replace("8160", "8161"))
    with pytest.raises(UsageError, match="max_gen_toks 32 need 8193 tokens"):
        check_suite(load_suite(path), check_data=False)


def test_the_model_entry_max_length_is_the_limit(tmp_path):
    assert check(tmp_path, 9000, model_extra=", max_length: 9012") == []
    with pytest.raises(UsageError, match=r"nsa-tiny takes 2048 \(its max_length\)"):
        check(tmp_path, 2048, model_extra=", max_length: 2048")


def test_a_chat_template_counts_its_own_tokens(tmp_path):
    """SmolLM2's template (its default system turn included) wraps the prompt in ~30 tokens."""
    tokenizer = load_tokenizer("smollm2-135m")
    framing = framing_tokens(tokenizer, chat=True)
    assert 10 < framing < 60
    # the measured framing matches a real prompt rendered as lm-eval renders it, to a token
    doc = make_niah_doc(tokenizer, 300, 50, 0)
    messages = [{"role": "user", "content": doc["input"]},
                {"role": "assistant", "content": doc["gen_prefix"]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert abs(len(tokenizer(rendered)["input_ids"]) - 300 - framing) <= 1
    suite = SUITE.replace("pretrained: nsa-tiny, attention: nsa", "pretrained: smollm2-135m, attention: full")
    path = tmp_path / "chat.yaml"
    path.write_text(suite.format(longest=8192 - 12 - framing, answer=12, model_extra="",
                                 task_extra="\n    apply_chat_template: true"))
    assert check_suite(load_suite(path), check_data=False) == []
    path.write_text(suite.format(longest=8192 - 12 - framing + 1, answer=12, model_extra="",
                                 task_extra="\n    apply_chat_template: true"))
    with pytest.raises(UsageError, match=f"about {framing} chat-template tokens"):
        check_suite(load_suite(path), check_data=False)


def test_a_task_that_includes_nsa_niah_is_checked_too(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "my_niah.yaml").write_text("include: " + str(_niah_yaml()) + "\ntask: my_niah\n")
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: mine
        include_path: {tasks}
        models: [{{pretrained: nsa-tiny, attention: nsa}}]
        tasks:
          - task: my_niah
            metadata: {{niah_lengths: [8192]}}
        """))
    with pytest.raises(UsageError, match="a 8192-token NIAH prompt and max_gen_toks 32"):
        check_suite(load_suite(path), check_data=False)


def _niah_yaml():
    from nsa_eval.tasks import TASKS_DIR

    return TASKS_DIR / "niah" / "nsa_niah.yaml"


def test_context_length_follows_lm_evals_rule(tmp_path):
    """Config first (an fla config without the field gets fla's 2048, as the converted model
    does), then the tokenizer's model_max_length, else lm-eval's 2048."""
    fla = tmp_path / "fla"
    fla.mkdir()
    fla_config = dict(model_type="nsa", hidden_size=64, num_hidden_layers=1, num_heads=4, vocab_size=61)
    (fla / "config.json").write_text(json.dumps(fla_config))
    assert context_length(fla) == (2048, f"{fla}'s config max_position_embeddings")
    (fla / "config.json").write_text(json.dumps(dict(fla_config, max_position_embeddings=65536)))
    assert context_length(fla)[0] == 65536

    gpt2 = tmp_path / "gpt2"  # GPT2Config names its context n_positions
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 4096}))
    assert context_length(gpt2) == (4096, f"{gpt2}'s config n_positions")

    nameless = tmp_path / "nameless"  # a model type whose config has no context field
    nameless.mkdir()
    (nameless / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    (nameless / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 3000}))
    assert context_length(nameless) == (3000, f"{nameless}'s tokenizer model_max_length")
    (nameless / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))
    assert context_length(nameless)[0] == 2048


def test_an_answer_that_fills_the_context_is_refused(tmp_path):
    """lm-eval asserts max_gen_toks < max_length only after the model has loaded."""
    with pytest.raises(UsageError) as err:
        check(tmp_path, 512, answer=8192)
    assert str(err.value).startswith(f"{tmp_path / 'fit.yaml'}: tasks[0] (nsa_niah) on models (entry "
                                     "'tiny'): max_gen_toks 8192 leaves no room for a prompt in the 8192 "
                                     "tokens nsa-tiny takes")


def test_the_shipped_paper_suite_sets_room_for_its_64k_grid(tmp_path):
    """configs/paper.yaml's max_length is what lets its 65,536-token NIAH cells through."""
    from pathlib import Path

    paper = Path(__file__).resolve().parents[1] / "configs" / "paper.yaml"
    text = paper.read_text()
    assert "  max_length: 65568" in text
    path = tmp_path / "paper.yaml"
    path.write_text(text.replace("  max_length: 65568", "  max_length: 65567"))
    with pytest.raises(UsageError, match="a 65536-token NIAH prompt and max_gen_toks 32 need 65568"):
        check_suite(load_suite(path), check_data=False, runs_here=False)


def test_a_system_instruction_without_a_chat_template_counts(tmp_path):
    """lm-eval writes the system instruction straight before the prompt as plain text."""
    instruction = "Answer with the number only. " * 20
    framing = framing_tokens(load_tokenizer("nsa-tiny"), system_instruction=instruction)
    assert framing > 100
    extra = f"\n    system_instruction: {json.dumps(instruction)}"
    assert check(tmp_path, 8192 - 12 - framing, task_extra=extra) == []
    with pytest.raises(UsageError, match=f"about {framing} tokens of system_instruction"):
        check(tmp_path, 8192 - 12 - framing + 1, task_extra=extra)


def test_what_the_check_cannot_measure_is_one_usage_error(tmp_path):
    with pytest.raises(UsageError) as err:  # the bundled tokenizers have no chat template
        check(tmp_path, 2048, task_extra="\n    apply_chat_template: true")
    assert "cannot measure the NIAH prompt's framing with nsa-tiny's tokenizer" in str(err.value)
    assert "expected a tokenizer with a chat template" in str(err.value)
    path = tmp_path / "fit.yaml"
    path.write_text(SUITE.format(longest=2048, answer="lots", model_extra="", task_extra=""))
    with pytest.raises(UsageError, match=r"tasks\[0\]\.gen_kwargs\.max_gen_toks: expected a positive int"):
        load_suite(path)  # refused with the suite's other values, before the context is measured


def test_a_vllm_entry_without_max_length_sizes_its_own_context(tmp_path):
    """vLLM reads rope scaling too (a YaRN model runs past max_position_embeddings): not checked."""
    from nsa_eval.suite.checks import check_context_fits

    path = tmp_path / "fit.yaml"
    path.write_text(SUITE.format(longest=65536, answer=12, model_extra="", task_extra="").replace(
        "pretrained: nsa-tiny, attention: nsa", "pretrained: full-tiny, attention: full, backend: vllm"))
    check_context_fits(load_suite(path))
    path.write_text(path.read_text().replace("backend: vllm", "backend: vllm, max_length: 8192"))
    with pytest.raises(UsageError, match=r"full-tiny takes 8192 \(its max_length\)"):
        check_context_fits(load_suite(path))


def test_groups_with_inline_subgroups_are_walked(tmp_path):
    """mmlu_generative nests {group: ..., task: [...]} items: its 57 generation leaves are checked."""
    path = tmp_path / "gen.yaml"
    path.write_text(textwrap.dedent("""\
        name: gen
        models: [{pretrained: full-tiny, attention: full}]
        tasks: [{task: mmlu_generative, gen_kwargs: {max_gen_toks: 8192}}]
        """))
    with pytest.raises(UsageError, match="max_gen_toks 8192 leaves no room"):
        check_suite(load_suite(path), check_data=False)


def test_a_remote_code_config_is_read_without_its_code(tmp_path):
    """An auto_map config is read as plain fields: no prompt to trust remote code, no code run."""
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm", "max_position_embeddings": 4096,
        "auto_map": {"AutoConfig": "configuration_mine.MyConfig"}}))
    (custom / "configuration_mine.py").write_text("raise SystemExit('remote code ran')\n")
    assert context_length(custom) == (4096, f"{custom}'s config max_position_embeddings")

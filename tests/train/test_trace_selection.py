"""scripts/trace_niah_selection.py on the bundled nsa-tiny: the needle is found in the prompt and
the forced local blocks are selected by every (layer, KV head) pair when the needle sits in them."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_niah_selection.py"


@pytest.fixture(scope="module")
def trace():
    spec = importlib.util.spec_from_file_location("trace_niah_selection", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_of_a_needle_in_the_local_blocks(trace, one_torch_thread):
    import torch

    from nsa_eval.models.loading import load_pretrained
    from nsa_eval.train.niah_eval import build_docs

    model, tokenizer = load_pretrained("nsa-tiny", dtype="float32")
    model.eval()
    (doc,) = build_docs(tokenizer, [768], [100.0], samples=1, progress=False)
    with torch.no_grad():
        row = trace.trace_doc(model, tokenizer, doc, "cpu")
    digits = tokenizer(doc["answer"], add_special_tokens=False)["input_ids"]
    prompt = tokenizer(doc["prompt"], add_special_tokens=False)["input_ids"]
    assert prompt[row["needle_start"] : row["needle_start"] + len(digits)] == digits
    assert row["pairs"] == model.config.num_hidden_layers * model.config.num_key_value_heads
    assert sum(row["is_digit"]) == len(digits) == 7
    # depth 100: the needle ends the haystack, inside the two local blocks every query must keep
    assert all(b >= (len(prompt) - 1) // model.config.select_size - 1 for b in row["needle_blocks"])
    assert row["pairs_selecting_needle"] == [row["pairs"]] * len(row["right"])


def test_refuses_a_model_without_nsa_selection(trace, capsys):
    with pytest.raises(SystemExit) as exit_info:
        trace.main(["--checkpoint", "full-tiny", "--lengths", "512"])
    assert exit_info.value.code == 2
    assert "not an NSA model" in capsys.readouterr().err

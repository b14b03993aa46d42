"""configs/long.yaml (issue 56): what it asks for, a clear stop while its checkpoints are not trained
yet, and a clean validation once tiny random checkpoints stand where it expects the trained ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from nsa_eval.cli import main
from nsa_eval.suite import check_suite, load_suite
from tests.suite_fixtures import make_tiny_llama

LONG = Path(__file__).resolve().parents[1] / "configs" / "long.yaml"
NIAH_LENGTHS = [1024, 2048, 4096, 8192, 16384, 24576, 32768, 40960, 49152, 65536]
MAIN = ["nsa-long", "nsa-long-nowindow", "full-long", "full-long:sink_window", "full-long:topk",
        "full-long:quest", "full-long:h2o"]
SWEEP = ["nsa-long@n8", "nsa-long@n4", "nsa-long@n3"]


def test_the_long_suite_asks_for_issue_56s_matrix():
    suite = load_suite(LONG)
    models = {m.label: m for m in suite.models}
    assert list(models) == MAIN + SWEEP
    assert {m.pretrained for m in suite.models} == {f"runs/long/{name}/checkpoint"
                                                     for name in ("nsa", "nsa-nowindow", "full")}
    assert {m.dtype for m in suite.models} == {"bfloat16"} and {m.device for m in suite.models} == {"cuda"}
    for label in MAIN[3:]:  # the baselines on the full model at the paper's budget
        model = models[label]
        assert (model.pretrained, model.sink, model.local, model.sparse_prefill) == (
            "runs/long/full/checkpoint", 128, 512, True)
        assert model.budget == (640 if model.attention == "sink_window" else 2560)  # sink + local
    assert [models[label].params.get("num_selected") for label in ["nsa-long", *SWEEP]] == [None, 8, 4, 3]
    niah, multikey, multihop = suite.tasks
    assert niah.task == "nsa_niah" and niah.metadata["niah_lengths"] == NIAH_LENGTHS
    assert len(niah.metadata["niah_depths"]) == 10 and niah.split == "niah_lengths"
    assert (multikey.task, multihop.task) == ("nsa_niah_multikey", "nsa_niah_multihop")
    assert all(t.split == "niah_lengths" for t in suite.tasks)  # every cell is one length: it resumes
    cells = suite.cells()
    assert {c.model.label for c in cells if c.task is multikey} == set(MAIN)
    assert len(cells) == len({c.key for c in cells}) == 10 * 10 + 2 * 4 * 7


def test_validate_stops_at_the_first_checkpoint_not_trained_yet(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(LONG)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"nsa-eval: error: {LONG}: models (entry 'nsa-long').pretrained: checkpoint directory "
                   f"'runs/long/nsa/checkpoint' does not exist (relative to the current directory, "
                   f"{tmp_path}); expected a directory with config.json, a hub name, or one of: "
                   "smollm2-135m, nsa-tiny, full-tiny")


def _tiny_nsa(out: Path, tokenizer_dir: Path, window: int) -> None:
    """A random 2-layer NSA checkpoint (1 initial + 2 local of 16 selected blocks) and the tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from nsa_eval.models.configuration_nsa import NSAConfig
    from nsa_eval.models.modeling_nsa import NSAForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = NSAConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, block_len=8, stride=4, select_size=8,
                       num_selected=16, window=window, max_position_embeddings=65536,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    NSAForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A folder with runs/long/{nsa,nsa-nowindow,full}/checkpoint: tiny random stand-ins."""
    root = tmp_path_factory.mktemp("long")
    full = make_tiny_llama(root / "runs/long/full/checkpoint")
    _tiny_nsa(root / "runs/long/nsa/checkpoint", full, window=16)
    _tiny_nsa(root / "runs/long/nsa-nowindow/checkpoint", full, window=0)
    return root


def test_the_shipped_file_validates_once_the_checkpoints_exist(trained, monkeypatch, capsys):
    import torch

    monkeypatch.chdir(trained)
    warnings = check_suite(load_suite(LONG), runs_here=False)  # the task index and the context too
    if not torch.cuda.is_available():
        assert len(warnings) == 1 and "'cuda': no CUDA GPU is visible" in warnings[0]
    assert main(["validate", str(LONG)]) == 0
    out = capsys.readouterr().out
    assert f"suite 'long' is valid: 10 models x 3 tasks = {10 * 10 + 2 * 4 * 7} cells" in out
    assert "nsa-long@n3/niah@65536" in out and "full-long:h2o/multihop@65536" in out
    assert not (trained / "runs/long/eval").exists()  # validate writes nothing


def test_a_top_n_below_the_checkpoints_forced_blocks_is_refused(trained, monkeypatch, tmp_path):
    """The issue's top-n 2 on a checkpoint that always selects 1 initial + 2 local blocks."""
    from nsa_eval.errors import UsageError

    monkeypatch.chdir(trained)
    path = tmp_path / "long.yaml"
    path.write_text(LONG.read_text().replace("nsa-long@n3", "nsa-long@n2").replace("num_selected: 3}",
                                                                                  "num_selected: 2}"))
    with pytest.raises(UsageError, match=r"models \(entry 'nsa-long@n2'\)\.params: runs/long/nsa/checkpoint: "
                                         r"num_selected 2 is below the 3 blocks"):
        check_suite(load_suite(path), check_tasks=False, runs_here=False)

"""`nsa-eval train`: flags are checked before any work, --tiny runs end to end, --match copies."""

import json

from nsa_eval.cli import main


def test_tiny_run_then_matched_run(tmp_path, capsys, tiny_corpus_dir):
    out, data = str(tmp_path / "full"), str(tiny_corpus_dir)
    assert main(["train", "--attention", "full", "--out", out, "--tiny", "--steps", "2", "--data", data,
                 "--retrieval-lengths", "96", "64"]) == 0
    assert "done: full 2 steps" in capsys.readouterr().out
    code = main(["train", "--attention", "full", "--out", str(tmp_path / "again"), "--tiny",
                 "--match", str(tmp_path / "full"), "--data", data])
    assert code == 0
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert a["tokens"] == b["tokens"] and a["final_eval"] == b["final_eval"]
    assert a["config"]["mix"]["retrieval_lengths"] == b["config"]["mix"]["retrieval_lengths"] == [64, 96]


def test_bad_flags_exit_2_before_work(tmp_path, capsys):
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x"), "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x"), "--match", str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x"), "--steps", "3",
                 "--retrieval-lengths", "1024", "4096"]) == 2
    assert "--retrieval-lengths 4096" in capsys.readouterr().err
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x"), "--steps", "3",
                 "--num-selected", "2"]) == 2
    assert "--num-selected must be >= 3" in capsys.readouterr().err


def test_nsa_geometry_flags_reach_the_model(tmp_path, tiny_corpus_dir):
    out = tmp_path / "nsa"
    assert main(["train", "--attention", "nsa", "--out", str(out), "--tiny", "--steps", "1",
                 "--data", str(tiny_corpus_dir), "--num-selected", "4", "--window", "32"]) == 0
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert (config["num_selected"], config["window"]) == (4, 32)
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()

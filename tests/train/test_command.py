"""`nsa-eval train`: flags are checked before any work, --tiny runs end to end, --match copies."""

import json

from nsa_eval.cli import main


def test_tiny_run_then_matched_run(tmp_path, capsys, tiny_corpus_dir):
    out, data = str(tmp_path / "full"), str(tiny_corpus_dir)
    assert main(["train", "--attention", "full", "--out", out, "--tiny", "--steps", "2", "--data", data,
                 "--retrieval-lengths", "96", "64", "--retrieval-fraction", "0.75",
                 "--distractors", "2", "--kv-heads", "4", "--layers", "1"]) == 0
    assert "done: full 2 steps" in capsys.readouterr().out
    assert main(["train", "--attention", "full", "--out", str(tmp_path / "again"), "--tiny",
                 "--match", str(tmp_path / "full"), "--data", data, "--layers", "2"]) == 2
    assert "--match copies the model's shape from" in capsys.readouterr().err
    code = main(["train", "--attention", "full", "--out", str(tmp_path / "again"), "--tiny",
                 "--match", str(tmp_path / "full"), "--data", data])
    assert code == 0
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert a["tokens"] == b["tokens"] and a["final_eval"] == b["final_eval"]
    assert a["config"]["mix"]["retrieval_lengths"] == b["config"]["mix"]["retrieval_lengths"] == [64, 96]
    assert a["config"]["mix"]["retrieval_fraction"] == b["config"]["mix"]["retrieval_fraction"] == 0.75
    assert a["config"]["mix"]["distractors"] == b["config"]["mix"]["distractors"] == 2
    assert a["config"]["model"] == b["config"]["model"]  # the shape too: 4 KV heads, 1 layer
    assert (b["config"]["model"]["num_kv_heads"], b["config"]["model"]["num_layers"]) == (4, 1)


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
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x"), "--steps", "3",
                 "--retrieval-fraction", "1.5"]) == 2
    assert "--retrieval-fraction must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(["train", "--attention", "full", "--out", str(tmp_path / "x"), "--steps", "3",
                 "--head-dim", "40"]) == 2
    assert "--head-dim must be a multiple of 16" in capsys.readouterr().err
    assert main(["train", "--attention", "full", "--out", str(tmp_path / "x"), "--steps", "3",
                 "--distractors", "-1"]) == 2
    assert "--distractors must be in [0, " in capsys.readouterr().err
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x"), "--steps", "3",
                 "--kv-heads", "3"]) == 2
    assert "--kv-heads must divide the 8 query heads, got 3" in capsys.readouterr().err
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x"), "--steps", "3",
                 "--layers", "0"]) == 2
    assert "--layers must be >= 1, got 0" in capsys.readouterr().err


def test_nsa_geometry_flags_reach_the_model(tmp_path, tiny_corpus_dir):
    out = tmp_path / "nsa"
    assert main(["train", "--attention", "nsa", "--out", str(out), "--tiny", "--steps", "1",
                 "--data", str(tiny_corpus_dir), "--num-selected", "4", "--window", "32",
                 "--head-dim", "32", "--kv-heads", "4", "--layers", "3", "--compress-norm"]) == 0
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert (config["num_selected"], config["window"], config["head_dim"]) == (4, 32, 32)
    assert config["compress_norm"] is True
    assert (config["num_key_value_heads"], config["num_hidden_layers"]) == (4, 3)
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_a_run_split_by_stop_and_resume_equals_one_run(tmp_path, capsys, tiny_corpus_dir, one_torch_thread):
    from safetensors.torch import load_file

    data = str(tiny_corpus_dir)
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    base = ["train", "--attention", "nsa", "--tiny", "--data", data]
    assert main([*base, "--out", whole, "--steps", "4"]) == 0
    assert main([*base, "--out", split, "--steps", "4", "--stop-after-minutes", "1e-9"]) == 0
    assert "unfinished: nsa at step 1/4" in capsys.readouterr().out
    assert (tmp_path / "split" / "resume.pt").exists() and not (tmp_path / "split" / "summary.json").exists()
    # an unfinished run is neither restarted by accident nor resumed with other settings
    assert main([*base, "--out", split, "--steps", "4"]) == 2
    assert "holds an unfinished run" in capsys.readouterr().err
    assert main([*base, "--out", split, "--resume", "--lr", "0.1"]) == 2
    assert "drop --lr" in capsys.readouterr().err
    assert main(["train", "--attention", "full", "--out", split, "--resume", "--tiny", "--data", data]) == 2
    assert "holds a nsa run" in capsys.readouterr().err
    assert main([*base, "--out", split, "--resume"]) == 0
    assert "done: nsa 4 steps" in capsys.readouterr().out
    assert not (tmp_path / "split" / "resume.pt").exists()
    a = load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert main([*base, "--out", split, "--resume"]) == 2  # finished: nothing to resume


def test_resume_needs_a_saved_run(tmp_path, capsys):
    assert main(["train", "--attention", "nsa", "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "no unfinished run" in capsys.readouterr().err
    assert main(["train", "--attention", "both", "--out", str(tmp_path), "--resume"]) == 2
    assert "one model per run" in capsys.readouterr().err


def test_corpus_sources_checked_before_work_and_recorded(tmp_path, capsys, tiny_corpus_dir):
    new = tmp_path / "data-new"
    base = ["train", "--attention", "full", "--steps", "1", "--tiny"]
    assert main(base + ["--out", str(tmp_path / "x"), "--data", str(new),
                        "--corpus-sources", "stdlib", "no_such_package_xyz"]) == 2
    assert "'no_such_package_xyz' is not an installed package" in capsys.readouterr().err
    assert not new.exists()  # nothing was built
    assert main(base + ["--out", str(tmp_path / "x"), "--data", str(tiny_corpus_dir),
                        "--corpus-sources", "stdlib"]) == 2
    assert "already holds a corpus of stdlib numpy" in capsys.readouterr().err

    assert main(base + ["--out", str(tmp_path / "std"), "--data", str(new),
                        "--corpus-sources", "stdlib"]) == 0
    assert json.loads((new / "manifest.json").read_text())["sources"] == ["stdlib"]
    summary = json.loads((tmp_path / "std" / "summary.json").read_text())
    assert summary["corpus"]["sources"] == ["stdlib"]
    # a run on another corpus cannot be matched: the tokens would differ
    assert main(["train", "--attention", "nsa", "--tiny", "--out", str(tmp_path / "m"),
                 "--match", str(tmp_path / "std"), "--data", str(tiny_corpus_dir)]) == 2
    assert "trained on another corpus" in capsys.readouterr().err

"""`nsa-eval train --recipe long`: its stages, their order and data, and resuming by rerunning."""

import json
from dataclasses import asdict, replace

import pytest

from nsa_eval.cli import main
from nsa_eval.train.long_context import LONG_CONTEXT, Stage, long_stages, run_long_recipe, stage_state
from nsa_eval.train.recipe import TrainConfig, tiny_config


def test_the_window_ablation_pretrains_on_nsa_tinys_tokens(tmp_path):
    """The stage trained from scratch repeats the bundled recipe but for the window, so its batches
    (a function of seed, step, batch, length and mix) are nsa-tiny's."""
    from nsa_eval.models.loading import resolve_checkpoint

    bundled = json.loads((resolve_checkpoint("nsa-tiny") / "training.json").read_text())["config"]
    stages = {s.name: s for s in long_stages(tmp_path)}
    pretrain = json.loads(json.dumps(asdict(stages["nsa-nowindow-2k"].config)))
    assert pretrain.pop("init_from") is None
    assert pretrain.pop("wide_selection") is None  # a field added after nsa-tiny was trained
    assert pretrain.pop("selection_distill") == 0.0  # likewise, and off as it was
    pretrain.pop("distill_queries")
    assert pretrain.pop("distill_answers") == 0.0  # likewise, and off
    assert pretrain["model"].pop("compress_norm") is False  # likewise, and off as it was
    assert pretrain["mix"].pop("far_needles") == 0.0  # likewise, and off
    assert pretrain["model"].pop("window") == 0
    bundled["model"].pop("window")
    assert pretrain == bundled


def test_the_long_models_continue_on_identical_tokens(tmp_path):
    stages = {s.name: s for s in long_stages(tmp_path)}
    long = [stages[name].config for name in ("nsa", "full", "nsa-nowindow")]
    assert [c.init_from for c in long] == ["nsa-tiny", "full-tiny",
                                           str(tmp_path / "nsa-nowindow-2k" / "checkpoint")]
    assert stages["nsa-nowindow"].after == "nsa-nowindow-2k"
    data = {(c.seed, c.seq_len, c.batch_size, c.steps, repr(c.mix)) for c in long}
    assert len(data) == 1 and {c.seq_len for c in long} == {LONG_CONTEXT} and LONG_CONTEXT >= 16384
    assert [c.model.window for c in long] == [256, 256, 0]
    assert [c.wide_selection for c in long] == [(64, 800), None, (64, 800)]  # NSA's first third on 64 blocks
    assert all(c.model.max_position_embeddings >= 65536 for c in long)  # NIAH to 64k


def test_far_needles_change_the_three_long_stages_alike(tmp_path):
    plain = {s.name: s.config for s in long_stages(tmp_path)}
    far = {s.name: s.config for s in long_stages(tmp_path, far_needles=0.25)}
    assert [far[n].mix.far_needles for n in far] == [0.0, 0.25, 0.25, 0.25]  # the 2k start stays nsa-tiny's
    assert len({repr(far[n].mix) for n in ("nsa", "full", "nsa-nowindow")}) == 1  # identical tokens
    for name in far:
        assert replace(far[name], mix=replace(far[name].mix, far_needles=0.0)) == plain[name]


@pytest.fixture
def small_stages(tmp_path):
    base = tiny_config("nsa")
    no_window = replace(base.model, window=0)
    out = tmp_path / "long"
    return out, [
        Stage("pre", replace(base, model=no_window)),
        Stage("full", replace(base, attention="full", seq_len=512)),
        Stage("long", replace(base, seq_len=512, steps=3, init_from=str(out / "pre" / "checkpoint"),
                              model=replace(no_window, max_position_embeddings=4096)), after="pre"),
    ]


def test_stages_run_after_their_inputs_and_start_from_them(small_stages, tiny_corpus_dir, one_torch_thread):
    from safetensors.torch import load_file

    out, stages = small_stages
    lines = []
    assert run_long_recipe(out, tiny_corpus_dir, device="cpu", workers=0, stages=stages, echo=lines.append)
    assert [stage_state(out / s.name) for s in stages] == ["done"] * 3
    starts = [line.split(":")[0] for line in lines if "starting" in line]
    assert starts.index("long") > starts.index("pre")  # it waited for its checkpoint
    pre = load_file(out / "pre" / "checkpoint" / "model.safetensors")
    weights = load_file(out / "long" / "checkpoint" / "model.safetensors")
    fresh = load_file(out / "full" / "checkpoint" / "model.safetensors")  # another random start
    name = "model.layers.0.mlp.up_proj.weight"
    # three steps on from its input, the continued model is far nearer to it than a fresh one is
    moved = (weights[name].float() - pre[name].float()).norm()
    assert moved < 0.25 * (fresh[name].float() - pre[name].float()).norm()
    assert (out / "loss_curves.png").stat().st_size > 0
    assert not any("swa" in name for name in weights)  # window 0: no window branch at all


def test_a_rerun_resumes_unfinished_stages_and_skips_done_ones(small_stages, tiny_corpus, tiny_corpus_dir,
                                                              one_torch_thread):
    from safetensors.torch import load_file

    from nsa_eval.train.recipe import train

    out, stages = small_stages
    pre = replace(stages[0], config=replace(stages[0].config, steps=4))
    train(pre.config, tiny_corpus, out / "pre", device="cpu", stop_after_minutes=1e-9, echo=lambda _: None)
    assert stage_state(out / "pre") == "partial"  # as a part cut off by --stop-after-minutes leaves it
    lines = []
    assert run_long_recipe(out, tiny_corpus_dir, device="cpu", workers=0, stages=[pre], echo=lines.append)
    assert any(line.startswith("pre: resuming") for line in lines)
    whole = out.parent / "whole"
    assert run_long_recipe(whole, tiny_corpus_dir, device="cpu", workers=0, stages=[pre], echo=lambda _: None)
    a = load_file(out / "pre" / "checkpoint" / "model.safetensors")
    b = load_file(whole / "pre" / "checkpoint" / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)  # the split run ends where the whole one does
    lines.clear()
    assert run_long_recipe(out, tiny_corpus_dir, device="cpu", workers=0, stages=[pre], echo=lines.append)
    assert not any("starting" in line or "resuming" in line for line in lines)  # nothing left to do


def test_recipe_refuses_flags_it_fixes(tmp_path, capsys):
    assert main(["train", "--recipe", "long", "--out", str(tmp_path), "--steps", "5"]) == 2
    assert "drop --steps" in capsys.readouterr().err
    assert main(["train", "--recipe", "long", "--out", str(tmp_path), "--attention", "nsa"]) == 2
    assert "drop --attention" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path)]) == 2
    assert "give --attention nsa|full|both, or --recipe long" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_recipe_refuses_another_corpus(tmp_path, capsys, tiny_corpus_dir):
    assert main(["train", "--recipe", "long", "--out", str(tmp_path / "long"), "--data",
                 str(tiny_corpus_dir)]) == 2
    assert "holds another corpus than the one nsa-tiny was trained on" in capsys.readouterr().err
    assert not (tmp_path / "long").exists()


def test_init_from_a_checkpoint_of_another_shape_is_refused(tmp_path, tiny_corpus):
    from nsa_eval.train.recipe import build_model, load_initial_weights

    model = build_model("nsa", replace(TrainConfig().model, window=0), tiny_corpus.tokenizer)
    with pytest.raises(ValueError, match="does not fit this model"):
        load_initial_weights(model, "nsa-tiny")


def test_the_compress_norm_variant_trains_its_own_nsa_start(tmp_path):
    plain = {s.name: s for s in long_stages(tmp_path)}
    stages = {s.name: s for s in long_stages(tmp_path, compress_norm=True)}
    assert list(stages) == ["nsa-2k", "nsa-nowindow-2k", "nsa", "full", "nsa-nowindow"]
    # nsa-tiny's recipe and tokens, with the norm: the start nsa-tiny would have been
    assert stages["nsa-2k"].config == replace(TrainConfig(), steps=6000,
                                              model=replace(TrainConfig().model, compress_norm=True))
    assert stages["nsa"].config.init_from == str(tmp_path / "nsa-2k" / "checkpoint")
    assert stages["nsa"].after == "nsa-2k"
    assert [stages[n].config.model.compress_norm for n in stages] == [True, True, True, False, True]
    assert stages["full"] == plain["full"]
    for name in ("nsa", "nsa-nowindow", "nsa-nowindow-2k"):  # the same runs but for the norm
        ours, theirs = stages[name].config, plain[name].config
        assert replace(ours, init_from=None, model=replace(ours.model, compress_norm=False)) == \
            replace(theirs, init_from=None)


def test_a_folder_of_another_variant_is_refused_before_any_work(tmp_path, capsys):
    from dataclasses import asdict

    from nsa_eval.train.long_context import foreign_stages

    out = tmp_path / "long"
    plain = {s.name: s for s in long_stages(out)}
    (out / "nsa").mkdir(parents=True)
    recorded = json.loads(json.dumps(asdict(plain["nsa"].config)))
    recorded["model"].pop("compress_norm")  # as runs from before the option recorded it
    (out / "nsa" / "summary.json").write_text(json.dumps({"config": recorded}))
    assert foreign_stages(out, long_stages(out)) == []  # the same recipe: done, skipped
    assert foreign_stages(out, long_stages(out, compress_norm=True)) == [str(out / "nsa")]
    missing_data = tmp_path / "no-corpus"
    assert main(["train", "--recipe", "long", "--compress-norm", "--out", str(out),
                 "--data", str(missing_data)]) == 2
    err = capsys.readouterr().err
    assert str(out / "nsa") in err and "another --out" in err
    assert not missing_data.exists()  # refused before the corpus is built

"""`nsa-eval bench profile`: each figure's kernels (on a CPU, operators) summed per step, the matrix
products apart, written as profile.md and profile.csv; bad arguments exit 2 before any model loads."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from nsa_eval.bench import harness
from nsa_eval.bench.profile import Kernel, profile_figures, write_profiles


def tiny_config(**overrides) -> harness.HarnessConfig:
    settings = dict(shape=harness.SHAPES["tiny"], lengths=(160,), methods=("full", "nsa"),
                    decode_batches=(1, 2), decode_tokens=4, repeats=2, budget=96, sink=16, local=32,
                    device="cpu")
    return harness.HarnessConfig(**(settings | overrides))


def test_each_figure_lists_its_operators_with_the_products_apart(tmp_path):
    profiles = profile_figures(tiny_config(decode_tokens=3, repeats=1), with_prefill=True,
                               log=lambda line: None)
    assert [(p.method, p.phase, p.batch) for p in profiles] == [
        (m, phase, b) for m in ("full", "nsa") for phase, b in (("prefill", 1), ("decode", 1), ("decode", 2))]
    for p in profiles:
        assert p.status == "ok"
        assert all(k.name.startswith("aten::") for k in p.kernels)
        assert [k.ms for k in p.kernels] == sorted((k.ms for k in p.kernels), reverse=True)
        assert 0 < p.product_ms < p.ms
        assert p.launches > 0
        assert (p.wall_ms is not None) is (p.phase == "decode")
    # a decode step of batch 2 runs the same operators as batch 1, as often
    nsa_1, nsa_2 = (p for p in profiles if p.method == "nsa" and p.phase == "decode")
    assert {k.name for k in nsa_1.kernels if k.product} == {k.name for k in nsa_2.kernels if k.product}

    md_path, csv_path = write_profiles(profiles, tmp_path / "out", top=5, command="nsa-eval bench profile")
    md = md_path.read_text()
    for p in profiles:
        assert f"## {p.method} {p.phase}, 160 tokens, batch {p.batch}" in md
    assert md.count("| operator | ms | share | calls |") == len(profiles)
    rows = list(csv.DictReader(csv_path.open()))
    for p in profiles:
        mine = [r for r in rows if (r["method"], r["phase"], int(r["batch"])) == (p.method, p.phase, p.batch)]
        assert len(mine) == len(p.kernels)
        assert sum(float(r["ms"]) for r in mine) == pytest.approx(p.ms, abs=1e-5)


@pytest.mark.parametrize("name, product", [
    ("nvjet_tst_128x64_64x4_2x1_v_bz_coopB_TNN", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", True),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>", True),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", True),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", True),
    ("aten::addmm", True),
    ("_decode_selected_kernel", False),
    ("triton_poi_fused_add_0", False),
    ("aten::add", False),
    ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t>>", False),
    ("void flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t>, 4, 1, true>", False),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>)",
     False),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", False),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", False),
])
def test_matrix_products_are_told_by_their_kernels_names(name, product):
    assert Kernel(name, 1.0, 1.0).product is product


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--top", "0"], "--top must be >= 1"),
    (["--methods", "flash"], "--methods: unknown flash"),
    (["--shape", "huge"], "--shape: expected one of"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
])
def test_bad_arguments_exit_2_before_any_model_loads(args, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "nsa_eval.cli", "bench", "profile", "--device", "cpu",
                           "--shape", "tiny", "--out", str(tmp_path / "p"), *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "p").exists()


def test_the_command_writes_its_two_files(tmp_path):
    (tmp_path / "taken").write_text("a file")
    refused = subprocess.run([sys.executable, "-m", "nsa_eval.cli", "bench", "profile", "--device", "cpu",
                              "--shape", "tiny", "--out", str(tmp_path / "taken")], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "is a file; expected a folder" in refused.stderr
    done = subprocess.run([sys.executable, "-m", "nsa_eval.cli", "bench", "profile", "--device", "cpu",
                           "--shape", "tiny", "--lengths", "128", "--decode-batch", "1", "--steps", "2",
                           "--methods", "nsa", "--out", str(tmp_path / "p")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["profile.csv", "profile.md"]
    assert "## nsa decode, 128 tokens, batch 1" in done.stdout


@pytest.mark.gpu
def test_an_nsa_step_on_the_gpu_shows_its_kernels_each_layer():
    """On a GPU the profile lists kernels, not operators: an NSA decode step of the tiny shape (2 layers)
    runs each of nsa_decode's four kernels once a layer, its compressor at one step in `stride`, and cuBLAS
    products; full attention's step has products too."""
    config = tiny_config(device="cuda", lengths=(1024,), decode_batches=(1,), decode_tokens=32, repeats=1)
    full, nsa = profile_figures(config, log=lambda line: None)
    assert full.status == nsa.status == "ok"
    launches = {k.name: k.launches for k in nsa.kernels}
    layers = config.shape.layers
    for kernel in ("decode_cmp_kernel", "decode_importance_kernel", "_decode_selected_kernel",
                   "_decode_merge_kernel"):
        assert launches.get(kernel) == layers, (kernel, sorted(launches))
    # the paper's stride: 2 of the 32 consecutive steps complete a block
    assert launches.get("_write_block_kernel") == pytest.approx(layers / 16)
    assert 0 < nsa.product_ms < nsa.ms and 0 < full.product_ms < full.ms
    assert nsa.wall_ms > 0 and not any(k.name.startswith("aten::") for k in nsa.kernels)

"""Shared memory of the default launch configurations, compiled ahead of time for the H200 (sm_90).

Run 5 on the H200 caught a configuration that compiled in bf16 but not in float32 (the compression
dk/dv with 128-key tiles needs 262,656 bytes of shared memory, the limit is 232,448). These tests
compile the backward kernels the way the defaults launch them, for both dtypes, without a GPU
(Triton's NVIDIA backend and its bundled ptxas), in a fresh process: the interpreter, which other
kernel tests use, leaves triton.language patched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

H200_SHARED_LIMIT = 232_448  # bytes per block (227 KB)

COMPILE = r"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from nsa_eval.kernels import _triton_utils as u, selection as s

def shared(kernel, pointers, consts, config):
    sig, attrs, it = {}, {}, iter(pointers)
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif len(attrs) < len(pointers):
            sig[name], attrs[(i,)] = next(it), [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name.startswith("scale") else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return compile(src, target=GPUTarget("cuda", 90, 32), options=config).metadata.shared

out = {}
for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    p = "*" + name
    for branch in ("cmp", "swa"):
        cfg = u._band_config(None if branch == "cmp" else 512, "dkv", dtype)
        consts = dict(HAS_WINDOW=branch == "swa", DK=128, DV=128, BDK=128, BDV=128, BM=cfg.pop("BM"),
                      BN=cfg.pop("BN"), UPCAST=False,
                      SPLIT_MASK=u._split_mask(None if branch == "cmp" else 512, "dkv"))
        pointers = [p] * 4 + ["*fp32"] * 4
        out[f"band dkv {branch} {name}"] = shared(u._band_bwd_dkv_kernel, pointers, consts, cfg)
    GP = 16
    consts = dict(DK=128, DV=128, BDK=128, BDV=128, GP=GP, BQ=max(1, s.SELECTED_DKV_ROWS // GP), BS=64,
                  FUSE_DQ=s.SELECTED_DQ == "fused", UPCAST=False)
    config = dict(num_warps=8) | s.SELECTED_DKV_CONFIG
    out[f"selected dkv {name}"] = shared(s._selected_dkv_kernel, [p] * 4 + ["*fp32"] * 2 + ["*i32"] * 4
                                         + ["*fp32"] * 3, consts, config)
print(json.dumps(out))
"""


def test_backward_kernels_fit_h200_shared_memory():
    """G = 16, d = 128, the paper's blocks: every default dk/dv launch fits in bf16 and float32."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(shared) == 6
    too_big = {k: v for k, v in shared.items() if v > H200_SHARED_LIMIT}
    assert not too_big, f"over the H200's {H200_SHARED_LIMIT} bytes of shared memory: {too_big}"

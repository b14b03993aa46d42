"""Shared memory of the default launch configurations, compiled ahead of time for the H200 (sm_90).

Run 5 on the H200 caught a configuration that compiled in bf16 but not in float32 (the compression
dk/dv with 128-key tiles needs 262,656 bytes of shared memory, the limit is 232,448). These tests
compile the kernels the way the defaults launch them, for both dtypes, without a GPU
(Triton's NVIDIA backend and its bundled ptxas), in a fresh process: the interpreter, which other
kernel tests use, leaves triton.language patched.
"""

from __future__ import annotations

from tests.kernels.sm90 import H200_SHARED_LIMIT, json_from_fresh_python

COMPILE = r"""
import json
import torch
from nsa_eval.kernels import _triton_utils as u, selection as s
from tests.kernels.sm90 import compile_sm90, pointers_then_scalars

def shared(kernel, pointers, consts, config):
    types = pointers_then_scalars(kernel, pointers, consts)
    return compile_sm90(kernel, types, consts, config).metadata.shared

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
        cfg = u._band_config(None if branch == "cmp" else 512, "fwd", dtype)
        consts = dict(HAS_WINDOW=branch == "swa", DK=128, DV=128, BDK=128, BDV=128, BM=cfg.pop("BM"),
                      BN=cfg.pop("BN"), UPCAST=False,
                      SPLIT_MASK=u._split_mask(None if branch == "cmp" else 512, "fwd"))
        out[f"band fwd {branch} {name}"] = shared(u._band_fwd_kernel, [p] * 4 + ["*fp32"], consts, cfg)
    for GP in (16, 4, 1):  # fewer heads: more positions a program
        launch = s.importance_launch("reshape", GP, dtype)
        rows = launch.pop("rows")
        consts = dict(DK=128, BDK=128, GP=GP, BT=rows // GP, BNS=16, RATIO=4, GROUP_FIRST=True,
                      RESHAPE=True, K=1, UPCAST=False, SPLIT_MASK=s.IMPORTANCE_SPLIT_MASK,
                      LANES=s.IMPORTANCE_LANE_MAP, block_len=32, stride=16, select_size=64)
        out[f"importance G'={GP} {name}"] = shared(s._importance_kernel, [p, p, "*fp32", "*fp32"], consts,
                                                   launch)
    GP = 16
    consts = dict(DK=128, DV=128, BDK=128, BDV=128, GP=GP, BT=1, BS=64, NP=16, BACKWARD=False, UPCAST=False)
    selected = [p] * 3 + ["*i32", p, "*fp32"] + [p, "*fp32", p]
    fwd = s._selected_pipelined_kernel
    out[f"selected fwd {name}"] = shared(fwd, selected, consts, s.SELECTED_FWD_CONFIG)
    consts = dict(consts, GP=4, BT=4)  # G = 4: four positions a program
    out[f"selected fwd G=4 {name}"] = shared(fwd, selected, consts, s.SELECTED_FWD_CONFIG_MULTI)
    launch = s.importance_launch("broadcast", GP, dtype)
    consts = dict(DK=128, BDK=128, GP=GP, BT=launch.pop("rows") // GP, BNS=16, RATIO=4, GROUP_FIRST=True,
                  RESHAPE=False, K=0, UPCAST=False, SPLIT_MASK=s.IMPORTANCE_SPLIT_MASK, LANES=False,
                  block_len=32, stride=16, select_size=64)
    out[f"importance broadcast {name}"] = shared(s._importance_kernel, [p, p, "*fp32", "*fp32"], consts,
                                                 launch)
    consts = dict(DK=128, DV=128, BDK=128, BDV=128, GP=GP, BQ=max(1, s.SELECTED_DKV_ROWS // GP), BS=64,
                  FUSE_DQ=s.SELECTED_DQ == "fused", UPCAST=False)
    config = s.selected_dkv_launch(dtype, 128, 128)
    out[f"selected dkv {name}"] = shared(s._selected_dkv_kernel, [p] * 4 + ["*fp32"] * 2 + ["*i32"] * 4
                                         + ["*fp32"] * 3, consts, config)
print(json.dumps(out))
"""


def test_default_launches_fit_h200_shared_memory():
    """G = 16, d = 128, the paper's blocks: the banded forwards and dk/dv, the importance kernel (both
    maps; the reshape map also at G' = 4 and 1, whose programs hold more positions), the selected
    forward (G = 16 and G = 4) and dk/dv, each as its default launch, fit in bf16 and float32."""
    shared = json_from_fresh_python(COMPILE)
    assert len(shared) == 22
    too_big = {k: v for k, v in shared.items() if v > H200_SHARED_LIMIT}
    assert not too_big, f"over the H200's {H200_SHARED_LIMIT} bytes of shared memory: {too_big}"

"""The budgeted prefill's kernels (kernels/budget_attention.py, budget_topk.py, budget_quest.py) compiled for
sm_90 without a GPU, as they launch at Llama-3.2-1B's attention (G = 4, head dim 64) and at head dim 128,
in bf16 and float32: each compiles (the interpreter tests cannot show a GPU-only compile error) and fits
the H200's shared memory."""

from __future__ import annotations

from tests.kernels.sm90 import H200_SHARED_LIMIT, json_from_fresh_python

COMPILE = r"""
import json
import torch
from nsa_eval.baseline_kernels import budget_attention as ba
from nsa_eval.baseline_kernels import budget_quest as bq
from nsa_eval.baseline_kernels import budget_topk as bt
from nsa_eval.kernels._triton_utils import pow2
from tests.kernels.sm90 import shared_bytes as shared

out = {}
for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    for G, D in ((4, 64), (1, 128)):
        cfg = ba._config(G, dtype)
        options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        tiles = dict(GP=cfg["GP"], BT=cfg["BT"], BN=cfg["BN"], UPCAST=False)
        p = "*" + name
        for selects in (False, True):
            consts = dict(D=D, DV=D, BD=pow2(D), BDV=pow2(D), SELECTS=selects, **tiles)
            pointers = [p] * 4 + ["*fp32", "*i32", "*i32", "*i32"]
            out[f"fwd selects={selects} G={G} D={D} {name}"] = shared(ba._budget_fwd_kernel, pointers, consts,
                                                                      options)
        pointers = [p, p, "*fp32", "*fp32", "*i32", "*i32", "*fp32", "*i32"]
        consts = dict(D=D, BD=pow2(D), **tiles)
        out[f"collect G={G} D={D} {name}"] = shared(bt._collect_kernel, pointers, consts, options)
        qcfg = bq._quest_config(G, dtype)
        qoptions = dict(num_warps=qcfg["num_warps"], num_stages=qcfg["num_stages"])
        qtiles = dict(GP=qcfg["GP"], BT=qcfg["BT"], BN=qcfg["BN"], UPCAST=False)
        pages = [(16, False), (16, True)] + ([(1, False)] if (G, name) == (4, "bf16") else [])
        for PS, skip in pages:  # page 1: a key tile spans two mask words (the word-per-key reading)
            consts = dict(D=D, DV=D, BD=pow2(D), BDV=pow2(D), PS=PS, ONE_WORD=(32 * PS) % qcfg["BN"] == 0,
                          SKIP=skip, **qtiles)
            pointers = [p] * 4 + ["*i32"] * 4
            out[f"quest PS={PS} skip={skip} G={G} D={D} {name}"] = shared(bq._quest_fwd_kernel, pointers,
                                                                          consts, qoptions)
for cap in (256, 4096):
    pointers = ["*fp32", "*i32", "*i32", "*i32", "*fp32", "*i32"]
    out[f"select cap={cap}"] = shared(bt._select_kernel, pointers, dict(BR=max(1, 4096 // cap), BC=cap),
                                      dict(num_warps=4))
for BC in (512, 4096, 8192):  # Quest's page select at 8k, 64k and 128k tokens (pages of 16)
    pointers = ["*fp32", "*i32", "*i32"]
    out[f"page select BC={BC}"] = shared(bq._page_select_kernel, pointers,
                                         dict(PS=16, BR=max(1, 4096 // BC), BC=BC),
                                         dict(num_warps=4 if BC <= 4096 else 8))
print(json.dumps(out))
"""


def test_budget_kernels_compile_and_fit_h200_shared_memory():
    shared = json_from_fresh_python(COMPILE)
    assert len(shared) == 26
    too_big = {k: v for k, v in shared.items() if v > H200_SHARED_LIMIT}
    assert not too_big, f"over the H200's {H200_SHARED_LIMIT} bytes of shared memory: {too_big}"

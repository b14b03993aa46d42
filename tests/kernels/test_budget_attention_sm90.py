"""The budgeted prefill's kernels (kernels/budget_attention.py, budget_topk.py, budget_quest.py) compiled for
sm_90 without a GPU, as they launch at Llama-3.2-1B's attention (G = 4, head dim 64) and at head dim 128,
in bf16 and float32: each compiles (the interpreter tests cannot show a GPU-only compile error), fits the
H200's shared memory, and the launches at the 1B shape in bf16 keep their loops' values in registers (no
local-memory load or store inside a loop: a spill there costs more than the tile's arithmetic)."""

from __future__ import annotations

from nsa_eval.baseline_kernels.budget_attention import SINK_WINDOW_CONFIGS as ba_configs
from tests.kernels.sm90 import H200_SHARED_LIMIT, json_from_fresh_python

COMPILE = r"""
import json, os, re, subprocess, tempfile
import torch
import triton

from nsa_eval.baseline_kernels import budget_attention as ba
from nsa_eval.baseline_kernels import budget_quest as bq
from nsa_eval.baseline_kernels import budget_topk as bt
from nsa_eval.kernels._triton_utils import pow2
from tests.kernels import sm90

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def spills_in_loops(cubin):
    # local-memory loads and stores (register spills) between a loop's label and its branch back
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True).stdout
    labels, code = {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*\.L_x_(\d+):", line)
        if label:
            labels[label.group(1)] = len(code)
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            code.append(line)
    loops = [(labels[m.group(1)], i) for i, line in enumerate(code)
             if (m := re.search(r"BRA\s.*\.L_x_(\d+)", line)) and labels.get(m.group(1), i + 1) <= i]
    return sum(1 for a, b in loops for line in code[a:b + 1] if re.search(r"\b(STL|LDL)\b", line))


def usage(kernel, pointers, consts, options):
    # (shared bytes, spills in loops) of the kernel compiled as it launches at the benchmark's shapes
    # (pointers, strides and sizes divisible by 16, as `tests.kernels.sm90.shared_bytes` specialises)
    types = sm90.pointers_then_scalars(kernel, pointers, consts)
    consts = sm90.with_constexpr_defaults(kernel, consts)
    divisible = [i for i, arg in enumerate(kernel.arg_names) if arg not in consts
                 and (i < len(pointers) or sm90.is_divisible_scalar(arg))]
    compiled = sm90.compile_sm90(kernel, types, consts, options, divisible)
    return compiled.metadata.shared, spills_in_loops(compiled.asm["cubin"])


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
            out[f"fwd selects={selects} G={G} D={D} {name}"] = usage(ba._budget_fwd_kernel, pointers, consts,
                                                                     options)
        pointers = [p, p, "*fp32", "*fp32", "*i32", "*i32", "*i64"]
        consts = dict(D=D, BD=pow2(D), **tiles)
        out[f"collect G={G} D={D} {name}"] = usage(bt._collect_kernel, pointers, consts, options)
        pointers = [p, p, "*fp32", "*fp32", "*fp32", "*fp32", "*i32", "*i32"]
        consts = dict(D=D, BD=pow2(D), NB=bt.NB, **tiles)
        out[f"count G={G} D={D} {name}"] = usage(bt._count_kernel, pointers, consts, options)
        consts = dict(D=D, BD=pow2(D), GP=cfg["GP"], BT=cfg["BT"], BNS=cfg["BN"], UPCAST=False)
        out[f"sample G={G} D={D} {name}"] = usage(bt._sample_kernel, [p, p, "*fp32"], consts, options)
        qcfg = bq._quest_config(G, dtype)
        qoptions = dict(num_warps=qcfg["num_warps"], num_stages=qcfg["num_stages"])
        qtiles = dict(GP=qcfg["GP"], BT=qcfg["BT"], BN=qcfg["BN"], UPCAST=False)
        for PS in (16, 1):  # page 1: the per-key reading (`_quest_keep`), a tile spanning two mask words
            one_word = (32 * PS) % qcfg["BN"] == 0
            consts = dict(D=D, DV=D, BD=pow2(D), BDV=pow2(D), PS=PS, ONE_WORD=one_word,
                          SLOTS=one_word and qcfg["BN"] // PS <= 16, **qtiles)
            pointers = [p] * 4 + ["*i32"] * 4
            out[f"quest PS={PS} G={G} D={D} {name}"] = usage(bq._quest_fwd_kernel, pointers, consts, qoptions)
        bcfg = bq.BOUNDS_CONFIG
        consts = dict(D=D, BD=pow2(D), GP=pow2(G, 1), BT=max(1, bcfg["rows"] // pow2(G, 1)), BP=bcfg["BP"],
                      UPCAST=False)
        boptions = dict(num_warps=bcfg["num_warps"], num_stages=options["num_stages"])
        out[f"bounds G={G} D={D} {name}"] = usage(bq._bounds_kernel, [p, p, p, "*fp32"], consts, boptions)
# the autotuners' choices at the 1B shape (G = 4, d = 64, bf16)
for BN, w, st in ba.SINK_WINDOW_CONFIGS:
    consts = dict(D=64, DV=64, BD=64, BDV=64, SELECTS=False, GP=4, BT=4 * w, BN=BN, UPCAST=False)
    out[f"sink_window BN={BN} warps={w} stages={st} G=4 D=64 bf16"] = usage(
        ba._budget_fwd_kernel, ["*bf16"] * 4 + ["*fp32", "*i32", "*i32", "*i32"], consts,
        dict(num_warps=w, num_stages=st))
for w, st in bq.QUEST_LAUNCHES:
    consts = dict(D=64, DV=64, BD=64, BDV=64, PS=16, ONE_WORD=True, SLOTS=True, GP=4, BT=16, BN=64,
                  UPCAST=False)
    out[f"quest warps={w} stages={st} G=4 D=64 bf16"] = usage(
        bq._quest_fwd_kernel, ["*bf16"] * 4 + ["*i32"] * 4, consts, dict(num_warps=w, num_stages=st))
for BW, TPW in ((16, 8), (128, 8), (256, 8)):  # Quest's plans at 8k, 64k and 128k tokens (pages of 16)
    consts = dict(GP=4, BT=16, BN=64, PS=16, BW=BW, TPW=TPW, CW=min(BW, bq.PLAN_WORDS), READ_BITS=True)
    out[f"plan BW={BW}"] = usage(bq._plan_kernel, ["*i32"] * 6, consts, dict(num_warps=4))
for cap in (256, 4096):
    for pos in (False, True):
        pointers = ["*i64" if pos else "*fp32", "*i32", "*i32", "*fp32", "*i32"]
        BR, warps = ba.kth_key_launch(cap)
        consts = dict(BR=BR, BC=cap, POS=pos)
        out[f"select cap={cap} pos={pos}"] = usage(bt._select_kernel, pointers, consts, dict(num_warps=warps))
for BC in (512, 4096, 8192):  # Quest's page select at 8k, 64k and 128k tokens (pages of 16; WIDE at 128k)
    pointers = ["*fp32", "*i32", "*i32"]
    BR, warps = ba.kth_key_launch(BC)
    consts = dict(PS=16, BR=BR, BC=BC, **ba.kth_key_counts(BC, 16))
    out[f"page select BC={BC}"] = usage(bq._page_select_kernel, pointers, consts, dict(num_warps=warps))
print(json.dumps(out))
"""


def test_budget_kernels_compile_and_fit_h200_shared_memory():
    usage = json_from_fresh_python(COMPILE)
    assert len(usage) == 2 * 2 * 8 + len(ba_configs) + 3 + 3 + 4 + 3
    too_big = {k: shared for k, (shared, _) in usage.items() if shared > H200_SHARED_LIMIT}
    assert not too_big, f"over the H200's {H200_SHARED_LIMIT} bytes of shared memory: {too_big}"
    hot = [k for k in usage if k.endswith("G=4 D=64 bf16") and not k.startswith("quest PS=1 ")]
    assert len(hot) == 7 + len(ba_configs) + 3
    hot += [k for k in usage if k.startswith("plan ")]  # its loop over mask words, 64 rows a program
    spilled = {k: usage[k][1] for k in hot if usage[k][1]}
    assert not spilled, f"local loads/stores inside loops at the 1B shape: {spilled}"

"""The two ways the importance kernel maps probabilities onto selection blocks
(`importance.IMPORTANCE_MAP`: "broadcast", "reshape"): equal importances up to float32 rounding and
the same selected blocks (also against the PyTorch reference), on the CPU through Triton's
interpreter; and both compile for sm_90 at the benchmark's launch (no GPU needed), with ptxas's
register and spill counts."""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from nsa_eval.kernels import importance
from nsa_eval.kernels import reference as ref
from nsa_eval.kernels._triton_utils import interpreting
from nsa_eval.kernels.topk import topk_blocks
from tests.kernels.sm90 import compile_sm90, json_from_fresh_python
from tests.kernels.test_triton_kernels import assert_same_selection

interpreted = pytest.mark.skipif(not interpreting(),
                                 reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

GEOMETRIES = {  # (block_len, stride, select_size): K, the farthest selection block ahead reached
    "paper": (32, 16, 64),  # K = 1
    "fla": (64, 64, 64),  # K = 0
    "l64-d16-s32": (64, 16, 32),  # K = 2
}
GROUPS = {"G1": (2, 2), "G4": (4, 1), "G16": (16, 1)}  # (Hq, Hkv)


def shifts(block_len, stride, select_size):
    """K by brute force: the largest k with a token of some compressed block in selection block k."""
    ratio = select_size // stride
    return max((r * stride + block_len - 1) // select_size for r in range(ratio))


def importances(monkeypatch, mapping, q, k_cmp, lse, geometry):
    block_len, stride, select_size = geometry
    monkeypatch.setattr(importance, "IMPORTANCE_MAP", mapping)
    return importance.block_importance(q, k_cmp, lse, block_len=block_len, stride=stride,
                                      select_size=select_size, scale=q.shape[-1] ** -0.5)


@interpreted
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_reshape_matches_broadcast(monkeypatch, geometry, group):
    """Importances equal up to float32 rounding; the blocks chosen from them identical to each other
    and, up to ties, to the reference's."""
    block_len, stride, select_size = GEOMETRIES[geometry]
    assert shifts(block_len, stride, select_size) <= importance.IMPORTANCE_RESHAPE_MAX_K  # reshape runs
    (hq, hkv), T, d = GROUPS[group], 200, 16
    g = torch.Generator().manual_seed(7)
    tc = (T - block_len) // stride + 1
    q = torch.randn(1, T, hq, d, generator=g)
    k_cmp = torch.randn(1, tc, hkv, d, generator=g)
    lse = ref.compressed_attention(q, k_cmp, torch.zeros(1, tc, hkv, 1), block_len=block_len,
                                   stride=stride)[1].contiguous()  # [1, T, Hq]
    imp = {m: importances(monkeypatch, m, q, k_cmp, lse, GEOMETRIES[geometry])
           for m in ("broadcast", "reshape")}
    # written entries: blocks up to each row's own ([T * Hkv, Ns] rows (t, h))
    ns = imp["broadcast"].shape[1]
    own = (torch.arange(ns)[None, :] <= (torch.arange(T) // select_size)[:, None]).repeat_interleave(hkv, 0)
    torch.testing.assert_close(imp["reshape"][own], imp["broadcast"][own], rtol=1e-5, atol=1e-6)

    params = dict(num_selected=2, num_init=0, num_local=1)  # blocks 0 .. own - 1 compete for one slot
    idx = {m: topk_blocks(imp[m].masked_fill(~own, 0.0), T=T, num_kv_heads=hkv, select_size=select_size,
                          **params).view(1, T, hkv, -1) for m in imp}
    assert torch.equal(idx["reshape"], idx["broadcast"])
    idx_ref = ref.select_blocks(q, k_cmp, block_len=block_len, stride=stride, select_size=select_size,
                                **params)
    assert_same_selection(idx["reshape"], idx_ref, q, k_cmp,
                          dict(block_len=block_len, stride=stride, select_size=select_size))


@interpreted
@pytest.mark.parametrize("geometry,group", [("paper", "G3"), ("paper", "G8"), ("fla", "G1")])
def test_split_mask_and_lane_map(monkeypatch, geometry, group):
    """Chunks seen whole by every row without the mask (IMPORTANCE_SPLIT_MASK) and the lane-ordered map
    (IMPORTANCE_LANE_MAP, paper's sizes) give the importances of the masked, plain kernel up to float32
    rounding. T is long enough for unmasked chunks (64 compressed blocks a chunk at the paper's sizes);
    G = 3 has padding heads (G' = 4), which the unmasked chunks drop through lse = +inf."""
    block_len, stride, select_size = GEOMETRIES[geometry]
    hq, hkv = {"G1": (2, 2), "G3": (3, 1), "G8": (8, 1)}[group]
    T, d = 1300 if geometry == "paper" else 1100, 16
    g = torch.Generator().manual_seed(11)
    tc = (T - block_len) // stride + 1
    q = torch.randn(1, T, hq, d, generator=g)
    k_cmp = torch.randn(1, tc, hkv, d, generator=g)
    lse = ref.compressed_attention(q, k_cmp, torch.zeros(1, tc, hkv, 1), block_len=block_len,
                                   stride=stride)[1].contiguous()
    ns = -(-T // select_size)
    own = (torch.arange(ns)[None, :] <= (torch.arange(T) // select_size)[:, None]).repeat_interleave(hkv, 0)
    imp = {}
    for fast in (False, True):
        monkeypatch.setattr(importance, "IMPORTANCE_SPLIT_MASK", fast)
        monkeypatch.setattr(importance, "IMPORTANCE_LANE_MAP", fast)
        imp[fast] = importances(monkeypatch, "reshape", q, k_cmp, lse, GEOMETRIES[geometry])[own]
    torch.testing.assert_close(imp[True], imp[False], rtol=1e-5, atol=1e-7)
    assert imp[True].abs().sum() > 0


def test_shift_count():
    """block_importance's closed form of K against brute force, over strides, ratios and lengths."""
    for stride in (8, 16, 64):
        for ratio in (1, 2, 4, 8):
            select_size = stride * ratio
            for block_len in range(stride, stride + 16 * select_size + 1, stride):
                k = (select_size - stride + block_len - 1) // select_size  # as in block_importance
                assert k == shifts(block_len, stride, select_size), (block_len, stride, select_size)


@interpreted
def test_reshape_falls_back_beyond_max_k(monkeypatch):
    """K = 3 (l = 96, d = 16, l' = 32) is past IMPORTANCE_RESHAPE_MAX_K: the broadcast map runs, bit
    for bit, and an unknown map is rejected."""
    geometry = (96, 16, 32)
    assert shifts(*geometry) > importance.IMPORTANCE_RESHAPE_MAX_K
    T, tc = 150, (150 - 96) // 16 + 1
    g = torch.Generator().manual_seed(3)
    q, k_cmp = torch.randn(1, T, 4, 16, generator=g), torch.randn(1, tc, 2, 16, generator=g)
    lse = ref.compressed_attention(q, k_cmp, torch.zeros(1, tc, 2, 1), block_len=96, stride=16)[1]
    lse = lse.contiguous()
    own = (torch.arange(-(-T // 32))[None, :] <= (torch.arange(T) // 32)[:, None]).repeat_interleave(2, 0)
    a = importances(monkeypatch, "broadcast", q, k_cmp, lse, geometry)
    b = importances(monkeypatch, "reshape", q, k_cmp, lse, geometry)
    assert torch.equal(a[own], b[own])
    with pytest.raises(ValueError, match="IMPORTANCE_MAP"):
        importances(monkeypatch, "nope", q, k_cmp, lse, geometry)


def compile_importance(mapping, rows, G=16, d=128, geometry=(32, 16, 64)):
    """PTX of the importance kernel compiled ahead of time for sm_90 as the benchmark launches it
    (T = 64k, Hq = 64, Hkv = 4: integer arguments divisible by 16 except Tc). Runs in the calling
    process, which must not have run the interpreter (it leaves triton.language patched)."""
    block_len, stride, select_size = geometry
    k = (select_size - stride + block_len - 1) // select_size
    reshape = mapping == "reshape" and k <= importance.IMPORTANCE_RESHAPE_MAX_K
    GP = importance.pow2(G, 1)
    ratio = select_size // stride
    consts = dict(DK=d, BDK=d, BDK2=0, GP=GP, BT=max(1, rows // GP), BNS=16, RATIO=ratio, GROUP_FIRST=True,
                  RESHAPE=reshape, K=k if reshape else 0, UPCAST=False,
                  SPLIT_MASK=importance.IMPORTANCE_SPLIT_MASK,
                  LANES=reshape and importance.IMPORTANCE_LANE_MAP and ratio == 4)
    consts.update(block_len=block_len, stride=stride, select_size=select_size)
    types = ["*bf16", "*bf16", "*fp32", "*fp32"] + ["i32"] * 11 + ["fp32"]
    names = importance._importance_kernel.arg_names
    divisible = [i for i, n in enumerate(names[:16]) if n not in ("TC", "scale_log2")]
    launch = dict(num_warps=4 if rows <= 64 else 8, num_stages=3)
    return compile_sm90(importance._importance_kernel, types, consts, launch, divisible).asm["ptx"]


def ptxas_usage(ptx, workdir):
    """(registers, spill store bytes, spill load bytes) from the bundled ptxas, or None without it."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return None
    src = Path(workdir) / "kernel.ptx"
    src.write_text(ptx)
    run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", os.devnull],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    info = run.stdout + run.stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    stores, loads = int(spills.group(1)), int(spills.group(2))
    return regs, stores, loads


def test_importance_variants_compile_for_h200(tmp_path):
    """G = 16, d = 128, the paper's blocks (BNS = 16, RATIO = 4) at 64 and 128 rows: both maps compile
    for sm_90; ptxas's registers and spills are printed (-s shows them), and the reshape map spills
    no more than the broadcast one."""
    code = f"""
import json
from tests.kernels.test_importance_variants import compile_importance, ptxas_usage
print(json.dumps({{f"{{m}} rows={{r}}": ptxas_usage(compile_importance(m, r), {str(tmp_path)!r})
                  for m in ("broadcast", "reshape") for r in (64, 128)}}))
"""
    usage = json_from_fresh_python(code)
    print("ptxas (registers, spill store bytes, spill load bytes):", usage)
    assert len(usage) == 4
    for rows in (64, 128):
        b, r = usage[f"broadcast rows={rows}"], usage[f"reshape rows={rows}"]
        if b is not None and r is not None:
            assert r[1] <= b[1], (rows, usage)


def test_reshape_launch_by_group():
    """`RESHAPE_LAUNCH_BY_GROUP` sets the warps and stages of the reshape map where it was measured (G' = 4,
    16-bit q/k dims up to 128) and nowhere else: not at G' = 16, not for float32 or the paper's 192,
    not for the broadcast map."""
    launch, config = importance.importance_launch, importance.IMPORTANCE_CONFIG
    assert launch("reshape", 4, torch.bfloat16, 128) == dict(rows=128, num_warps=4, num_stages=2)
    assert launch("reshape", 16, torch.bfloat16, 128) == config["reshape"]
    for dtype, dk in ((torch.float32, 128), (torch.bfloat16, 192), (torch.bfloat16, 256)):
        assert launch("reshape", 4, dtype, dk)["num_warps"] == config["reshape"]["num_warps"]
    assert launch("broadcast", 4, torch.bfloat16, 128) == config["broadcast"]

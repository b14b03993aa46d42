"""The banded kernels (compression and sliding-window branches) with their key / query loops split
into masked edge tiles and unmasked interior tiles (`band.BAND_SPLIT_MASK`), against the single
masked loop (bit for bit: same tiles, same order; also in either launch order, `longest_first`) and
the PyTorch reference, outputs, lse and gradients, on the
CPU through Triton's interpreter (tiles of BM = BN = 16 there, so interior tiles appear from a few
hundred tokens on); and the split kernels compiled for the H200 (sm_90) without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from nsa_eval.kernels import band
from nsa_eval.kernels import reference as ref
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.window import sliding_window_attention
from tests.kernels.sm90 import H200_SHARED_LIMIT, json_from_fresh_python
from tests.kernels.test_triton_kernels import TOL, grads, make, rel_err

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                      reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

CASES = {  # name: (branch, (B, T, Hq, Hkv, Dk, Dv), params); interior tiles in all but the last of each
    # odd T; compressed key tile 0 (tokens up to 271) is interior for the query blocks from 272 on
    "cmp-T333": ("cmp", (1, 333, 4, 2, 16, 32), dict(block_len=32, stride=16)),
    # fla layout: a tile of 16 keys ends at token 1023
    "cmp-fla-T1093": ("cmp", (1, 1093, 2, 1, 16, 16), dict(block_len=64, stride=64)),
    # one compressed key, queries 0..30 see none: masked tiles only
    "cmp-T40": ("cmp", (2, 40, 2, 1, 16, 16), dict(block_len=32, stride=16)),
    # per query block: a masked tile at the window's start, 3 interior tiles, the diagonal
    "swa-T301-w64": ("swa", (1, 301, 4, 2, 32, 16), dict(window=64)),
    "swa-T203-w40": ("swa", (1, 203, 2, 2, 16, 16), dict(window=40)),  # window not a tile multiple
    "swa-T11": ("swa", (1, 11, 2, 1, 16, 16), dict(window=64)),  # T below one block
}


def interior_tiles(T, TK, key_stride, key_offset, window=None, tile=16):
    """16 x 16 tiles of (query, key) pairs where every query sees every key, all in range: the tiles
    the split runs unmasked (counted from the definition, not from the kernels' arithmetic)."""
    t = torch.arange(T)[:, None]
    pos = torch.arange(TK)[None, :] * key_stride + key_offset
    ok = pos <= t
    if window is not None:
        ok &= pos > t - window
    nq, nk = -(-T // tile), -(-TK // tile)
    grid = torch.zeros(nq * tile, nk * tile, dtype=torch.bool)
    grid[:T, :TK] = ok
    return int(grid.view(nq, tile, nk, tile).all(3).all(1).sum())


def run_reference(branch, x, params):
    """Outputs ([o, lse] or [o]) and gradients [dq, dk, dv] of one branch's reference, for the output
    gradients `grads` draws (gradients through o and, where finite, lse)."""
    if branch == "cmp":
        ins = (x["q"], x["k_cmp"], x["v_cmp"])
        o, lse = ref.compressed_attention(*ins, **params)
        out = [o, torch.where(torch.isfinite(lse), lse, 0.0)]
        return [o.detach(), lse.detach()] + list(grads(out, ins))
    ins = (x["q"], x["k"], x["v"])
    o = ref.sliding_window_attention(*ins, **params)
    return [o.detach()] + list(grads([o], ins))


def run_triton(branch, x, params, **paths):
    """As `run_reference`, through `band_forward` and `band_backward` as the branch's autograd op calls
    them, with `paths` (`split_mask`, `longest_first`) chosen by the test."""
    q = x["q"].detach()
    if branch == "cmp":
        k, v = x["k_cmp"].detach(), x["v_cmp"].detach()
        geometry = dict(key_stride=params["stride"], key_offset=params["block_len"] - 1, split_heads=True)
    else:
        k, v = x["k"].detach(), x["v"].detach()
        geometry = dict(key_stride=1, key_offset=0, window=params["window"])
    scale = q.shape[-1] ** -0.5
    forward = {name: value for name, value in geometry.items() if name != "split_heads"}
    o, lse = band.band_forward(q, k, v, scale=scale, **forward, **paths)
    g = torch.Generator().manual_seed(1)  # the output gradients `grads` draws
    do = torch.randn(o.shape, generator=g)
    dlse = None
    if branch == "cmp":
        dlse = torch.where(torch.isfinite(lse), torch.randn(lse.shape, generator=g), 0.0)
    dq, dk, dv = band.band_backward(q, k, v, o, lse, do, dlse, scale=scale, **geometry, **paths)
    return [o] + ([lse] if branch == "cmp" else []) + [dq, dk, dv]


@interpreter_only
@pytest.mark.parametrize("name", list(CASES))
def test_split_matches_masked_loop_and_reference(name):
    branch, shape, params = CASES[name]
    T = shape[1]
    x = make(*shape, **{k: v for k, v in params.items() if k != "window"})
    if branch == "cmp":
        TK = x["k_cmp"].shape[1]
        n = interior_tiles(T, TK, params["stride"], params["block_len"] - 1)
    else:
        n = interior_tiles(T, T, 1, 0, params["window"])
    assert (n > 0) == (name not in ("cmp-T40", "swa-T11")), n  # the unmasked interior is exercised

    split = run_triton(branch, x, params, split_mask=True)
    # the launch order changes which program runs when, not what it computes
    for a, b in zip(run_triton(branch, x, params, split_mask=True, longest_first=False), split, strict=True):
        assert torch.equal(a, b)
    masked = run_triton(branch, x, params, split_mask=False)
    for a, b in zip(split, masked, strict=True):
        assert torch.equal(a, b)
    # the branch's own op takes the split (with Triton 3.8 everywhere) and computes the same
    if branch == "cmp":
        op = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], **params)[0]
    else:
        op = sliding_window_attention(x["q"], x["k"], x["v"], **params)
    assert torch.equal(op, split[0])

    want = run_reference(branch, x, params)
    if branch == "cmp":
        lse, lse_ref = split.pop(1), want.pop(1)
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))  # queries that see no block
        finite = torch.isfinite(lse_ref)
        assert rel_err(lse[finite], lse_ref[finite]) < TOL
    for a, b in zip(split, want, strict=True):
        assert rel_err(a, b) < TOL


COMPILE = r"""
import json
import torch
from nsa_eval.kernels import _triton_utils as u, band
from tests.kernels.sm90 import compile_sm90, pointers_then_scalars

out = {}
for part, kernel, pointers in (("fwd", band._band_fwd_kernel, ["*bf16"] * 4 + ["*fp32"]),
                               ("dkv", band._band_bwd_dkv_kernel, ["*bf16"] * 4 + ["*fp32"] * 2 + ["*bf16"]
                                + ["*fp32"] * 2)):
    for branch in ("cmp", "swa"):
        cfg = band._band_config(None if branch == "cmp" else 512, part, torch.bfloat16)
        consts = dict(HAS_WINDOW=branch == "swa", DK=128, DV=128, BDK=128, BDK2=0, BDV=128, BM=cfg.pop("BM"),
                      BN=cfg.pop("BN"), UPCAST=False, SPLIT_MASK=True)
        if part == "dkv":
            consts["GATED"] = False  # gate_in_branches off, the default
        k = compile_sm90(kernel, pointers_then_scalars(kernel, pointers, consts), consts, cfg)
        out[f"{part} {branch}"] = dict(shared=k.metadata.shared, loops=k.asm["ttgir"].count("scf.for"))
print(json.dumps(out))
"""


def test_split_kernels_compile_for_h200():
    """The default (split) forward and dk/dv launches compile for sm_90 at d = 128 in bf16, with
    their separate loops (forward: interior + diagonal, + the window's start; dk/dv: the heads loop
    around diagonal + interior + window's end) and within the H200's shared memory."""
    got = json_from_fresh_python(COMPILE, timeout=600)
    min_loops = {"fwd cmp": 2, "fwd swa": 3, "dkv cmp": 4, "dkv swa": 4}
    for name, loops in min_loops.items():
        assert got[name]["loops"] >= loops, (name, got[name])
        assert got[name]["shared"] <= H200_SHARED_LIMIT, (name, got[name])


def test_launch_order_falls_back_beyond_grid_y():
    """The longest-first grid puts the tiles on CUDA's grid y (at most 65,535): beyond that, and with
    `longest_first` off, the tiles go on x in index order, and the kernels are told which."""
    assert band._launch(65535, 64) == ((64, 65535), 1)
    assert band._launch(65536, 64) == ((65536, 64), 0)
    assert band._launch(10, 64, longest_first=False) == ((10, 64), 0)


def test_split_mask_and_tma_parts():
    """Which kernels split their loops and which copy with TMA by default, per branch; the Triton the
    kernels compile with decides the window's backward (it splits from Triton 3.8 on)."""
    assert all(band._split_mask(None, part) for part in ("fwd", "dq", "dkv"))
    assert band._split_mask(512, "fwd") and band._split_mask(512, "dkv") == band.TRITON_38
    assert not band._split_mask(512, "fwd", split_mask=False)
    assert band._split_mask(None, "dq", split_mask=True)
    assert [band._tma(None, part) for part in ("fwd", "dq", "dkv")] == [True, False, True]
    assert all(band._tma(512, part) for part in ("fwd", "dq", "dkv"))
    assert band._tma(None, "dq", tma=True) and not band._tma(512, "fwd", tma=False)

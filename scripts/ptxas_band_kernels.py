"""Registers, spills and shared memory of the banded kernels compiled for the H200, no GPU needed.

    python scripts/ptxas_band_kernels.py

Compiles `_band_fwd_kernel`, `_band_bwd_dq_kernel` and `_band_bwd_dkv_kernel` (compression "cmp" and
window "swa" branches, the mask split off and on; dq and dk/dv also with the gates applied in them,
`prefill.GATE_IN_BRANCHES`; all of these also with TMA copies of the streamed tiles, `tma`:
K and V of the forward and dq, q and do of dk/dv, `band.BAND_TMA`) ahead of time for sm_90 at the
benchmark's launch
(d = 128, bf16, the default tiles; strides, T, HQ, G and the window specialised as divisible by 16,
as a launch at 64k would be) and prints what Triton's bundled ptxas reports. Numbers depend on the
Triton version: the H200 image runs Triton 3.6, this machine may not. Read them side by side, not as
absolutes. Run from the repository root (it uses tests/kernels/sm90.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must be unset before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from nsa_eval.kernels import band
from tests.kernels.sm90 import compile_sm90, pointers_then_scalars  # noqa: E402

DESC = "tensordesc<bf16[1,{rows},1,128]>"  # a TMA descriptor's type (`_triton_utils.tma_descriptor`)
TMA_ARGS = {"fwd": (1, 2, "BN"), "dq": (1, 2, "BN"), "dkv": (0, 3, "BM")}  # descriptor arguments, rows
KERNELS = {  # part: (kernel, its pointer arguments' types)
    "fwd": (band._band_fwd_kernel, ["*bf16"] * 4 + ["*fp32"]),
    "dq": (band._band_bwd_dq_kernel, ["*bf16"] * 4 + ["*fp32"] * 2 + ["*bf16"] * 2),
    "dkv": (band._band_bwd_dkv_kernel, ["*bf16"] * 4 + ["*fp32"] * 2 + ["*bf16"] + ["*fp32"] * 2),
}


def is_divisible_scalar(name: str) -> bool:
    """Strides, T, HQ, G, the window and the key stride: multiples of 16 at the benchmark's shape."""
    return (name[:3] in ("sq_", "sk_", "sv_", "so_") or name[:4] in ("skw_", "svw_")
            or name in ("T", "HQ", "G", "window", "key_stride"))


def ptxas_usage(ptx: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of one kernel's PTX."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    info = run.stdout + run.stderr
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups()
    return int(re.search(r"Used (\d+) registers", info).group(1)), int(stores), int(loads)


def compile_usage(kernel, pointers, consts, options, divisible=None) -> tuple[int, int, int, int]:
    """`kernel` compiled for sm_90 (pointer types first, then i32/fp32 scalars): (registers, spill
    store bytes, spill load bytes, shared memory bytes)."""
    types = pointers_then_scalars(kernel, pointers, consts)
    compiled = compile_sm90(kernel, types, consts, options, divisible)
    return (*ptxas_usage(compiled.asm["ptx"]), compiled.metadata.shared)


def main() -> int:
    print(f"triton {triton.__version__}; part branch split [gated]: registers, spill stores/loads (bytes), "
          "shared")
    for part, (kernel, pointers) in KERNELS.items():
        for branch in ("cmp", "swa"):
            # the backward's kernels also with the gates applied in them (prefill.GATE_IN_BRANCHES)
            variants = [(split, gated, tma) for tma in (False, True) for split in (False, True)
                        for gated in ((False, True) if part != "fwd" else (None,))]
            for split, gated, tma in variants:
                window = None if branch == "cmp" else 512
                cfg = band._band_config(window, part, torch.bfloat16, tma=tma)
                consts = dict(HAS_WINDOW=window is not None, DK=128, DV=128, BDK=128, BDK2=0, BDV=128,
                              BM=cfg.pop("BM"), BN=cfg.pop("BN"), UPCAST=False, SPLIT_MASK=split, TMA=tma)
                if gated is not None:
                    consts["GATED"] = gated
                types = list(pointers)
                if tma:
                    first, second, rows = TMA_ARGS[part]
                    types[first] = types[second] = DESC.format(rows=consts[rows])
                divisible = [i for i, name in enumerate(kernel.arg_names) if name not in consts
                             and (i < len(pointers) or is_divisible_scalar(name))]
                regs, stores, loads, shared = compile_usage(kernel, types, consts, cfg, divisible)
                label = f"{part:4s} {branch} split={split!s:5s}" + " gated" * bool(gated) + " tma" * tma
                print(f"{label}: {regs:3d} registers, spills {stores}/{loads}, shared {shared} ({cfg})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compile Triton kernels ahead of time for the H200 (sm_90) on a machine without a GPU.

Triton's NVIDIA backend and its bundled ptxas need no GPU. The compile must run in a fresh Python
without TRITON_INTERPRET: the interpreter, which the other kernel tests use, leaves triton.language
patched. So each test hands a snippet to `json_from_fresh_python`, and the snippet calls
`compile_sm90` and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
H200_SHARED_LIMIT = 232_448  # bytes of shared memory per block (227 KB)


def compile_sm90(kernel, types, consts: dict, options: dict, divisible=None):
    """`kernel` compiled for sm_90. `types`: the Triton types ("*bf16", "i32", "fp32", ...) of the
    arguments not in `consts`, in order; `divisible`: indices of arguments specialised as divisible by
    16, as a launch at the benchmark's shapes would (default: the leading pointers)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    consts = with_constexpr_defaults(kernel, consts)
    types = iter(types)
    signature = {name: "constexpr" if name in consts else next(types) for name in kernel.arg_names}
    if divisible is None:
        divisible = [i for i, name in enumerate(kernel.arg_names) if signature[name].startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return compile(src, target=GPUTarget("cuda", 90, 32), options=dict(options))


def with_constexpr_defaults(kernel, consts: dict) -> dict:
    """`consts` plus the defaults of the kernel's constexpr parameters it leaves out (a launch that
    does not pass them gets these)."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    return {**defaults, **consts}


def pointers_then_scalars(kernel, pointers, consts: dict) -> list[str]:
    """`types` for `compile_sm90` of a kernel whose pointers come first: the scalars after them are
    fp32 when named scale*, else i32."""
    consts = with_constexpr_defaults(kernel, consts)
    scalars = [name for name in kernel.arg_names if name not in consts][len(pointers):]
    return list(pointers) + ["fp32" if name.startswith("scale") else "i32" for name in scalars]


def is_divisible_scalar(name: str) -> bool:
    """Strides, T, HQ, G, the window and the key stride: multiples of 16 at the benchmark's shapes, as
    Triton specialises them at launch (without that no load is 16 bytes wide and no loop pipelined)."""
    return (name[:3] in ("sq_", "sk_", "sv_", "so_") or name[:4] in ("skw_", "svw_")
            or name in ("T", "HQ", "G", "window", "key_stride"))


def shared_bytes(kernel, pointers, consts: dict, options: dict) -> int:
    """Shared memory of `kernel` compiled for sm_90 with its pointers, strides and sizes specialised as
    multiples of 16, as a launch at the benchmark's shapes is (Triton then pipelines the loops, with
    more buffers: the 256-dim band forward needs twice the bytes it compiles to without that)."""
    types = pointers_then_scalars(kernel, pointers, consts)
    consts = with_constexpr_defaults(kernel, consts)
    divisible = [i for i, arg in enumerate(kernel.arg_names) if arg not in consts
                 and (i < len(pointers) or is_divisible_scalar(arg))]
    return compile_sm90(kernel, types, consts, options, divisible).metadata.shared


def json_from_fresh_python(code: str, timeout: int = 900):
    """Run `code` in a fresh Python (repository root, no interpreter, no GPU) and return the JSON of
    its last output line; skips the test where Triton's NVIDIA backend is not installed."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # compile only, even where a GPU exists
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])

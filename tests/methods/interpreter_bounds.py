"""A check that a Triton kernel run by the interpreter reads and writes only inside its tensor arguments.

On a GPU an out-of-bounds store corrupts memory silently (or later, elsewhere); under TRITON_INTERPRET=1
it corrupts the host heap. `in_bounds()` wraps the interpreter's masked loads and stores: every address
that a load or store touches (mask on) must lie in the storage of one of the launch's tensor arguments,
else AssertionError names the access. The interpreter's internals (`GridExecutor`, `InterpreterBuilder`)
are Triton's, not an API: where they are missing the check is skipped.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch


@contextlib.contextmanager
def in_bounds():
    """Every kernel launched in the block touches only its tensor arguments' storage (interpreter only)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    executor = getattr(interpreter, "GridExecutor", None)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if executor is None or not hasattr(builder, "create_masked_load"):
        pytest.skip("this Triton's interpreter has no GridExecutor / InterpreterBuilder to watch")
    ranges: list[tuple[int, int]] = []  # [start, end) of each tensor argument's storage, in bytes
    call, load, store = executor.__call__, builder.create_masked_load, builder.create_masked_store

    def check(ptrs, mask, what):
        addresses = ptrs.data[mask.data.astype(bool)] if mask is not None else ptrs.data.ravel()
        addresses = addresses.astype(np.int64)
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, end in ranges:
            inside |= (addresses >= start) & (addresses < end)
        assert inside.all(), f"kernel {what} outside its tensors at {addresses[~inside][:4].tolist()}"

    def watched_call(self, *args, **kwargs):
        ranges.clear()
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.Tensor):
                start = arg.untyped_storage().data_ptr()
                ranges.append((start, start + arg.untyped_storage().nbytes()))
        return call(self, *args, **kwargs)

    def watched_load(self, ptrs, mask, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *rest)

    def watched_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    executor.__call__, builder.create_masked_load, builder.create_masked_store = (
        watched_call, watched_load, watched_store)
    try:
        yield
    finally:
        executor.__call__, builder.create_masked_load, builder.create_masked_store = call, load, store

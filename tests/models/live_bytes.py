"""Bytes of the tensors alive, counted on the CPU as a GPU's allocator would hold them: a proxy for
`torch.cuda.max_memory_allocated` where there is no GPU (the Triton kernels run in the interpreter,
which allocates their outputs and scratch through torch as on a GPU, and works in numpy besides).

Every tensor an aten op returns inside `LiveBytes` is counted once per storage, from its allocation to
the moment the last tensor holding that storage dies; views share their base's bytes; tensors made
before the block (weights, inputs) and views of them count nothing. Sizes are exact (no allocator
rounding, no fragmentation)."""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """`live`: bytes of the storages allocated in the block and still held; `peak`: their maximum."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors holding it]
        self._tensors: dict[int, int] = {}  # id of a tensor counted -> its storage's data_ptr

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors_in}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or id(t) in self._tensors or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if ptr in self._storages:
                self._storages[ptr][1] += 1
            elif ptr in inputs or size == 0:  # a view of a tensor from outside, or nothing allocated
                continue
            else:
                self._storages[ptr] = [size, 1]
                self.live += size
                self.peak = max(self.peak, self.live)
            self._tensors[id(t)] = ptr
            weakref.finalize(t, self._release, id(t))
        return out

    def _release(self, tensor_id: int) -> None:
        ptr = self._tensors.pop(tensor_id)
        entry = self._storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[ptr]

    @contextmanager
    def section(self, record: list):
        """Appends to `record` the most bytes held inside the block above what was held at its start,
        once the block ends."""
        start, outer = self.live, self.peak
        self.peak = start
        try:
            yield
        finally:
            record.append(self.peak - start)
            self.peak = max(outer, self.peak)

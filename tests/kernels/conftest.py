"""Without a GPU the Triton kernels run on the CPU through Triton's interpreter; the variable must
be set before triton is imported anywhere. On a CUDA machine the kernels compile for the GPU (the
interpreter tests then skip themselves and `-m gpu` runs tests/kernels/test_gpu.py)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

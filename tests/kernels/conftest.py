"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter; the variable must be
set before triton is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

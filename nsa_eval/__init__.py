"""nsa-eval: Native Sparse Attention against full attention and sparse baselines."""

__version__ = "0.1.0"

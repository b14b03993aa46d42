"""Benchmarks behind `nsa-eval bench`: `kernels` (the Triton NSA kernels against SDPA) and `harness`
(whole models through the lm-eval adapter, every attention method against full attention)."""

"""nsa_eval.kernels (being built)."""

"""nsa_eval.methods (being built)."""

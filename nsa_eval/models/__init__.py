"""nsa_eval.models (being built)."""

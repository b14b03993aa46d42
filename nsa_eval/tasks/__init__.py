"""nsa_eval.tasks (being built)."""

"""The token budget of the sparse baselines, the one place its defaults are written.

`BudgetConfig()` is the paper's setting (NSA, arXiv:2502.11089, section 4.2): 2,560 keys per query =
128 leading (sink) + 512 most recent (local) + 1,920 chosen by the method. Every signature that takes
a budget (`apply_attention`, `load_for_eval`, the lm-eval adapter, the suite, `nsa-eval bench`)
defaults to these fields. Plain Python: the CLI and the suite read it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetConfig:
    """Budget settings shared by every method (see `nsa_eval.methods.apply_attention`).

    Attributes:
        budget: keys each query may attend to, sink and local included.
        sink: leading keys always kept.
        local: most recent keys always kept, the query itself included.
        sparse_prefill: hold every query to the budget (True), or only decode steps (False).
        dense_layers: the first `dense_layers` layers attend densely.
    """

    budget: int = 2560
    sink: int = 128
    local: int = 512
    sparse_prefill: bool = True
    dense_layers: int = 0

    @property
    def selected(self) -> int:
        """Keys the method chooses per query beyond sink and local."""
        return self.budget - self.sink - self.local

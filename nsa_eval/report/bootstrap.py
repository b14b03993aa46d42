"""Paired bootstrap confidence intervals for differences between two methods on the same documents.

Both methods answered the same documents, so resampling documents (not methods) keeps each pair
together: the interval reflects which documents happened to be in the benchmark, the main source
of noise on small benchmarks.
"""

from __future__ import annotations

import numpy as np


def paired_bootstrap(a: list[np.ndarray], b: list[np.ndarray], *, iters: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Difference mean(b) - mean(a) and its percentile bootstrap interval.

    Args:
        a, b: per-document scores of methods A and B, one array `[N_k]` per subtask k, aligned
            (b[k][i] and a[k][i] are the same document). With several subtasks the statistic is
            the unweighted mean of the subtask means (the paper's average), and each subtask's
            documents are resampled separately.
        iters: bootstrap resamples; seed: the generator seed, so reports are reproducible.

    Returns:
        (difference, low, high) with low/high the (1-level)/2 and (1+level)/2 percentiles.
    """
    rng = np.random.default_rng(seed)
    diffs = [np.asarray(bk, float) - np.asarray(ak, float) for ak, bk in zip(a, b, strict=True)]
    if not diffs or any(d.size == 0 for d in diffs):
        raise ValueError("paired_bootstrap needs at least one document per subtask")
    point = float(np.mean([d.mean() for d in diffs]))
    resampled = np.zeros(iters)
    for d in diffs:
        idx = rng.integers(0, d.size, size=(iters, d.size))  # [iters, N_k]
        resampled += d[idx].mean(axis=1) / len(diffs)  # [iters]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return point, float(low), float(high)

"""Paired bootstrap confidence intervals for differences between two methods on the same documents.

Both methods answered the same documents, so resampling documents (not methods) keeps each pair
together: the interval reflects which documents happened to be in the benchmark, the main source
of noise on small benchmarks.
"""

from __future__ import annotations

import numpy as np


def paired_bootstrap(a: list[np.ndarray], b: list[np.ndarray], *, iters: int = 2000, seed: int = 0,
                     level: float = 0.95, weights: list[float] | None = None) -> tuple[float, float, float]:
    """Difference mean(b) - mean(a) and its percentile bootstrap interval.

    Args:
        a, b: per-document scores of methods A and B, one array `[N_k]` per subtask k, aligned
            (b[k][i] and a[k][i] are the same document). With several subtasks the statistic is
            sum_k w_k * (subtask k's mean difference), and each subtask's documents are resampled
            separately (stratified), so the point estimate and every resample use the same weights.
        weights: w_k, normalised to sum 1; default equal (the unweighted mean of the subtask means,
            the paper's average). Weights proportional to N_k give the mean over all documents
            pooled (lm-eval's `weight_by_size: true`).
        iters: bootstrap resamples (>= 1); seed: the generator seed, so reports are reproducible.

    Returns:
        (difference, low, high) with low/high the (1-level)/2 and (1+level)/2 percentiles.
    """
    if isinstance(iters, bool) or not isinstance(iters, (int, np.integer)) or iters < 1:
        raise ValueError(f"paired_bootstrap needs iters >= 1, got {iters!r}")
    rng = np.random.default_rng(seed)
    diffs = [np.asarray(bk, float) - np.asarray(ak, float) for ak, bk in zip(a, b, strict=True)]
    if not diffs or any(d.size == 0 for d in diffs):
        raise ValueError("paired_bootstrap needs at least one document per subtask")
    w = np.full(len(diffs), 1.0) if weights is None else np.asarray(weights, float)
    if w.shape != (len(diffs),) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"paired_bootstrap needs one non-negative weight per subtask, got {weights!r}")
    w = w / w.sum()
    point = float(sum(wk * d.mean() for wk, d in zip(w, diffs, strict=True)))
    resampled = np.zeros(iters)
    for wk, d in zip(w, diffs, strict=True):
        idx = rng.integers(0, d.size, size=(iters, d.size))  # [iters, N_k]
        resampled += wk * d[idx].mean(axis=1)  # [iters]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return point, float(low), float(high)

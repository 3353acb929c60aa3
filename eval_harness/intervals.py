"""Percentile bootstrap intervals shared by the tasks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["mean_interval"]


def mean_interval(values: Sequence[float] | np.ndarray, num_bootstrap: int,
                  seed: int) -> list[float]:
    """95 % percentile bootstrap interval of the mean of ``values`` (resampled with
    replacement, ``num_bootstrap`` draws from a generator seeded with ``seed``)."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or not len(values):
        raise ValueError("a bootstrap interval needs a non-empty 1-D sample")
    rng = np.random.default_rng(seed)
    draws = [values[rng.integers(0, len(values), len(values))].mean()
             for _ in range(num_bootstrap)]
    return [float(v) for v in np.percentile(draws, [2.5, 97.5])]

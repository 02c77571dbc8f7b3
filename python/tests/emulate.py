"""Independent emulation of FP32 summation orders with NumPy scalars (each addition rounded
once to float32): the oracle the threshold tests compare against."""

from __future__ import annotations

from typing import List, Sequence

import numpy as np


def seq_sum(v: Sequence[np.float32]) -> np.float32:
    s = np.float32(0.0)
    for x in v:
        s = np.float32(s + np.float32(x))
    return s


def tree(parts: List[np.float32]) -> np.float32:
    while len(parts) > 1:
        parts = [np.float32(parts[i] + parts[i + 1]) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


def splitk_sum(v: Sequence[np.float32], parts: int) -> np.float32:
    """Split into ``parts`` contiguous chunks (the last may be shorter when the length does
    not divide), each summed sequentially, partials combined pairwise (a tree)."""
    n = len(v)
    size = -(-n // parts)
    partials = [seq_sum(v[i * size:(i + 1) * size]) for i in range(parts)]
    return tree(partials)


def rows(x: np.ndarray, f) -> np.ndarray:
    return np.array([f(list(r)) for r in x.reshape(-1, x.shape[-1])], dtype=np.float32).reshape(
        x.shape[:-1]
    )

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
    """Recursive halving (``Combine::Tree``): a first half of ⌈len/2⌉ partials and the rest,
    each combined the same way, then added."""
    if len(parts) == 1:
        return parts[0]
    h = -(-len(parts) // 2)
    return np.float32(tree(parts[:h]) + tree(parts[h:]))


def splitk_sum(v: Sequence[np.float32], parts: int) -> np.float32:
    """Split-K as the order is documented: part j holds terms ⌊jn/p⌋ … ⌊(j+1)n/p⌋ − 1, each
    summed sequentially, the partials combined by recursive halving (a tree)."""
    n = len(v)
    partials = [seq_sum(v[j * n // parts:(j + 1) * n // parts]) for j in range(parts)]
    return tree(partials)


def rows(x: np.ndarray, f) -> np.ndarray:
    return np.array([f(list(r)) for r in x.reshape(-1, x.shape[-1])], dtype=np.float32).reshape(
        x.shape[:-1]
    )

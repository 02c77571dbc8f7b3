"""Small models shared by the tracer's tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class Mlp(nn.Module):
    """Linear(d, hidden) → GELU → Linear(hidden, d)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

"""The dense feed-forward blocks of the two architectures; models/moe.py builds its experts' math and
shared experts from the same definitions, so it imports these rather than the architectures."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GELUMLP(nn.Module):
    """proj(gelu(fc x)) with the tanh approximation (GPT-2 / Megatron), biases on both linears."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020, arXiv 2002.05202)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

"""RMSNorm with the reference's arithmetic: normalise in float32, scale by the weight."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32; output in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

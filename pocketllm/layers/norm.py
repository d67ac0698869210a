"""The two RMSNorms of this model: zero-centred (weight stored as w, applied as 1 + w) and the
GDN's gated norm (plain weight, times silu(z)). Both compute in fp32 as HF does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.layers.sharding import ShardSource, read_all, sharded_param


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed) * F.silu(z.float())).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, key: str, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = sharded_param((dim,), [ShardSource(key, (dim,), read_all)], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_zero_centred(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, key: str, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = sharded_param((dim,), [ShardSource(key, (dim,), read_all)], dtype, device)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, z, self.weight, self.eps)

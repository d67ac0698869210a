"""The two RMSNorms of this model: zero-centred (weight stored as w, applied as 1 + w) and the
GDN's gated norm (plain weight, times silu(z)). Both compute in fp32 as HF does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.layers.sharding import ShardSource, read_all, sharded_param


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) per row in fp32, from one read of x and no full-size temporary."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.rsqrt(n.square_().div_(x.shape[-1]).add_(eps))


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The textbook form (float, pow, mean, rsqrt, two products) makes five full passes over fp32
    # temporaries; this makes three and computes the same fp32 value (measured 15-45% faster).
    out = x * inv_rms(x, eps)
    out.mul_(1.0 + weight.float())
    return out.to(x.dtype)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF rounds the normed value to the input dtype before the weight, so this does too.
    normed = (x * inv_rms(x, eps)).to(x.dtype)
    out = F.silu(z.float())
    out.mul_(weight * normed)
    return out.to(x.dtype)


def rms_norm_zero_centred_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3_5RMSNorm, written as it is there: what the fast form must equal."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def rms_norm_gated_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3_5RMSNormGated, written as it is there."""
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

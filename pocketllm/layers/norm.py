"""The two RMSNorms of this model: zero-centred (weight stored as w, applied as 1 + w) and the
GDN's gated norm (plain weight, times silu(z)). Both compute in fp32 as HF does; each has HF's
formula beside it as the reference its fast form is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.layers.sharding import ShardSource, read_all, sharded_param
from pocketllm.ops.row_blocks import by_row_blocks


def rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale in fp32, returned in x's dtype. torch's fused rms_norm
    is one op where the textbook form is five passes over fp32 temporaries; that matters most
    for decode's single rows, where every op is mostly dispatch. Many rows go by row blocks."""
    return by_row_blocks(lambda xb: F.rms_norm(xb.float(), (x.shape[-1],), scale, eps).to(x.dtype), x)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return by_row_blocks(lambda xb, zb: _rms_norm_gated_block(xb, zb, weight, eps), x, z)


def _rms_norm_gated_block(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF rounds the normed value to the input dtype before the weight, so this does too.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    out = F.silu(z.float())
    out.mul_(weight * normed)
    return out.to(x.dtype)


def rms_norm_zero_centred_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3_5RMSNorm, written as it is there: what RMSNorm (1 + w folded once by
    after_loading, then rms_norm_scaled) must equal."""
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

        self.scale: torch.Tensor | None = None

    def after_loading(self) -> None:
        # 1 + w in fp32: the weight never changes after loading.
        self.scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm takes a None scale as "no scale": fail instead of silently dropping 1 + w.
        if self.scale is None:
            raise RuntimeError("RMSNorm used before after_loading(): its fp32 scale is not made yet")
        return rms_norm_scaled(x, self.scale, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, key: str, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = sharded_param((dim,), [ShardSource(key, (dim,), read_all)], dtype, device)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, z, self.weight, self.eps)

"""The row-wise norms of this model as functions: the zero-centred RMSNorm's fp32 core, the GDN's
gated RMSNorm, and the l2 norm of q and k. Each computes in fp32 as HF does, many rows by row
blocks on a CPU (unless row_blocks=False: a device's pass shape); the two RMSNorms have HF's
formula beside them as the reference their fast forms are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops.row_blocks import by_row_blocks


def rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float, row_blocks: bool = True) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale in fp32, returned in x's dtype. torch's fused rms_norm
    is one op where the textbook form is five passes over fp32 temporaries; that matters most
    for decode's single rows, where every op is mostly dispatch. Many rows go by row blocks."""
    return by_row_blocks(lambda xb: F.rms_norm(xb.float(), (x.shape[-1],), scale, eps).to(x.dtype), x, row_blocks=row_blocks)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, row_blocks: bool = True) -> torch.Tensor:
    return by_row_blocks(lambda xb, zb: _rms_norm_gated_block(xb, zb, weight, eps), x, z, row_blocks=row_blocks)


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


def l2_normalize(x: torch.Tensor, eps: float = 1e-6, row_blocks: bool = True) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (HF's l2norm), by row blocks."""
    return by_row_blocks(lambda xb: _l2_normalize_block(xb, eps), x, out_dtype=torch.float32, row_blocks=row_blocks)


def _l2_normalize_block(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)

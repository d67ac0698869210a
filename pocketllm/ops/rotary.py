"""Partial NeoX rotary embedding on rows: the first rotary_dim dims of each head rotate as two
halves (the table of cos and sin per position is layers/rotary.py's)."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, rd/2]. Rotates in fp32, returns x's dtype."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, xf[..., 2 * half :]), dim=-1)
    return rotated.to(x.dtype)

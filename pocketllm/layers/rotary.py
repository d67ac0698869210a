"""Partial NeoX rotary embedding: the first `rotary_dim` dims of each head rotate as two halves.
Text-only positions make the checkpoint's mRoPE the plain 1-D rotation."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, rotary_dim: int, theta: float, device):
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))

    def cos_sin(self, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + rows, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)  # [T, rd/2]
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, rd/2]. Rotates in fp32, returns x's dtype."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, xf[..., 2 * half :]), dim=-1)
    return rotated.to(x.dtype)

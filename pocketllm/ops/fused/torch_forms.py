"""The torch forms of the fused decode calls that run in production: a norm with its residual add
and SiLU-and-multiply, with the compiled calls' signatures. The engine runs them where the compiled
form cannot (another dtype or device, no compiler, or POCKETLLM_FUSED_DECODE=0) and on a prompt's
rows where the compiled rows forms do not apply. The plain references the tests hold both forms to
are in reference.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops.norms import rms_norm_scaled


def add_rms_norm_torch(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float, row_blocks: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + x, rms_norm(h + x) * scale) for rows h, x [T, n]; x None means no add. row_blocks:
    as ops.norms.rms_norm_scaled's."""
    if x is not None:
        h = h + x
    return h, rms_norm_scaled(h, scale, eps, row_blocks)


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up

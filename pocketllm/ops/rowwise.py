"""The torch forms of a norm with its residual add and of SiLU-and-multiply, with the compiled
decode calls' signatures (ops/fused): what runs where the compiled form cannot (another dtype or
device, no compiler, or POCKETLLM_FUSED_DECODE=0), on a prompt's rows where the compiled rows forms
do not apply, and what the device kernels (ops/device) are held to. The plain references the tests
hold them to are in ops/fused/reference.py."""

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

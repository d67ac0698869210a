"""The torch forms of the fused decode calls, with the same signatures: what pocketllm.ops.fused
must equal up to fp32 summation order, and what the engine runs where the compiled form cannot
(another dtype or device, no compiler, or POCKETLLM_FUSED_DECODE=0). The torch forms of the Gated
DeltaNet and attention blocks are the layers' own paths (GatedDeltaNet.forward, GatedAttention.
forward): the compiled blocks take the same inputs and the tests compare the two."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops.norms import rms_norm_scaled


def add_rms_norm_reference(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + x, rms_norm(h + x) * scale) for rows h, x [T, n]; x None means no add."""
    if x is not None:
        h = h + x
    return h, rms_norm_scaled(h, scale, eps)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up

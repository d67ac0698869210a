"""The torch forms of the device kernels (kernels/), with the kernels' signatures: what the
custom ops run off CUDA, and what the tests hold the kernels to. Each is the form the layers run on a
CPU (ops/), taken whole over all rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops import causal_conv, norms
from pocketllm.ops.causal_conv import causal_conv1d_rows_indexed_
from pocketllm.ops import rowwise
from pocketllm.ops.rowwise import silu_mul_torch
from pocketllm.ops.paged_kv import decode_attention_rows_torch, write_kv_rows_torch, write_kv_torch
from pocketllm.ops.rotary import apply_rotary as apply_rotary_torch

# A device runs each over all of a pass's rows in one call: so do these, on any device (a CPU's
# row blocks are its own cache measure, which a device pass forced on a CPU in a test must not
# take either).


def add_rms_norm_torch(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + x, RMSNorm(h + x) * scale): ops.rowwise.add_rms_norm_torch over all rows."""
    return rowwise.add_rms_norm_torch(h, x, scale, eps, row_blocks=False)


def rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return norms.rms_norm_scaled(x, scale, eps, row_blocks=False)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return norms.rms_norm_gated(x, z, weight, eps, row_blocks=False)


def causal_conv1d_prefill_(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    # conv1d's [C, T] output transposed back: made row-major, as the kernel writes it.
    return causal_conv.causal_conv1d_prefill_(x, taps, state, row_blocks=False).contiguous()


def qk_l2_norm_torch(qk: torch.Tensor, heads_q: int, q_scale: float, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """qk [T, Hq + Hk, dk] -> q [T, Hq, dk] unit length times q_scale, k [T, Hk, dk] unit length,
    fp32 (the GDN layer's q and k for the gated delta rule)."""
    qk = norms.l2_normalize(qk, eps, row_blocks=False)
    return qk[:, :heads_q] * q_scale, qk[:, heads_q:]


def gdn_gates_torch(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv]; neg_a [Hv] fp32 (-exp(A_log)); dt_bias [Hv] -> (g, beta) [T, Hv] fp32."""
    beta = torch.sigmoid(b).float()
    g = neg_a * F.softplus(a.float() + dt_bias)
    return g, beta


__all__ = [
    "add_rms_norm_torch", "apply_rotary_torch", "causal_conv1d_prefill_", "causal_conv1d_rows_indexed_", "decode_attention_rows_torch",
    "gdn_gates_torch", "qk_l2_norm_torch", "rms_norm_gated", "rms_norm_scaled", "silu_mul_torch", "write_kv_rows_torch", "write_kv_torch",
]

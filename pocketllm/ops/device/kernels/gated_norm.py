"""The Gated DeltaNet's gated RMSNorm per head: rms_norm(x) * weight * silu(z), x and z [T, H, dv].
The torch form widens x and z, normalises, narrows, multiplies by the weight and by silu(z): six
passes over the rows where this reads x and z once.

One program per (row, head), one fixed-order reduction over the head: a row's bits do not depend on
how many rows the call has. Rounds where ops.norms.rms_norm_gated (HF's Qwen3_5RMSNormGated) does:
the normed value to x's dtype, its product with the weight in that dtype, the output once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import inv_sqrt, launch_options, rounded, row_strides, silu


@triton.jit
def _kernel(x_ptr, z_ptr, w_ptr, out_ptr, n, heads, x_row, x_head, z_row, z_head, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t, j = r // heads, r % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * x_row + j * x_head + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.div_rn(tl.sum(x * x, axis=0), n.to(tl.float32))
    normed = rounded(x * inv_sqrt(mean_sq + eps), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * z_row + j * z_head + cols, mask=mask, other=0.0).to(tl.float32)
    out = rounded(silu(z) * rounded(w * normed, dtype), dtype)
    tl.store(out_ptr + r * n + cols, out.to(dtype), mask=mask)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.norms.rms_norm_gated's contract: x, z [T, H, dv] or [T, dv] (last dim contiguous),
    weight [dv] in x's dtype; the output new and contiguous in x's dtype."""
    if z.shape != x.shape or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, z {tuple(z.shape)}, weight {weight.dtype}: z must match x's shape, weight its dtype")
    n = x.shape[-1]
    heads, x_row, x_head = row_strides(x)
    _, z_row, z_head = row_strides(z)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // n
    if rows:
        block = triton.next_power_of_2(n)
        _kernel[(rows,)](x, z, weight, out, n, heads, x_row, x_head, z_row, z_head, eps, BLOCK=block, **launch_options(block))
    return out

"""Partial NeoX rotary embedding of q or k, x [T, H, D]: the first 2 * half dims of each head
rotate as two halves by the row's cos and sin [T, half], the rest pass through
(layers.rotary.apply_rotary's contract). The torch form widens, slices, multiplies and
concatenates, a pass each; here each head row is read once.

One program per (row, head); elementwise in fp32 with each product rounded (no fma, as torch
computes), the result rounded once to x's dtype: a row's bits do not depend on how many rows the
call has."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import launch_options, rounded, row_strides


@triton.jit
def _kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n, half, heads, x_row, x_head, cs_row, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t, j = r // heads, r % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    first = cols < half
    rotated = cols < 2 * half
    row = x_ptr + t * x_row + j * x_head
    x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    # The other half's element of the pair: x2 for the first half, x1 for the second.
    partner = tl.load(row + tl.where(first, cols + half, cols - half), mask=rotated, other=0.0).to(tl.float32)
    f = tl.where(first, cols, cols - half)
    c = tl.load(cos_ptr + t * cs_row + f, mask=rotated, other=0.0)
    s = tl.load(sin_ptr + t * cs_row + f, mask=rotated, other=0.0)
    # x1 * c - x2 * s and x2 * c + x1 * s.
    out = tl.where(first, x * c - partner * s, tl.where(rotated, x * c + partner * s, x))
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + r * n + cols, rounded(out, dtype).to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous); cos, sin [T, half] fp32 with contiguous columns and the
    same strides, 2 * half <= D. Returns the rotated x [T, H, D], new and contiguous, in x's dtype."""
    t, heads, n = x.shape
    half = cos.shape[-1]
    if cos.shape != (t, half) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1 or 2 * half > n:
        raise ValueError(f"x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: cos and sin must be [T, half], 2 * half <= D")
    _, x_row, x_head = row_strides(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t:
        block = triton.next_power_of_2(n)
        _kernel[(t * heads,)](x, cos, sin, out, n, half, heads, x_row, x_head, cos.stride(0), BLOCK=block, **launch_options(block))
    return out

"""Residual add and zero-centred RMSNorm in one pass over each row: (h + x, rms_norm(h + x) *
scale), scale the fp32 1 + w. The torch form is an add, a widening copy, the norm and a narrowing
copy, each reading and writing all of a pass's rows; here each row is read once. Without x it is
the plain norm (the q/k norms of full attention, over [T, H, d] head rows).

One program per row, the row's sum of squares one reduction over a fixed block: a row's bits do
not depend on how many rows the call has. Rounds where add_rms_norm_torch does: the sum to h's
dtype (the norm reads the rounded sum), the output once from fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import inv_sqrt, launch_options, rounded, row_strides


@triton.jit
def _kernel(h_ptr, x_ptr, scale_ptr, sum_ptr, out_ptr, n, heads, h_row, h_head, x_row, x_head, eps,
            HAS_X: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t, j = r // heads, r % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    s = tl.load(h_ptr + t * h_row + j * h_head + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_X:
        x = tl.load(x_ptr + t * x_row + j * x_head + cols, mask=mask, other=0.0).to(tl.float32)
        s = rounded(s + x, dtype)
        tl.store(sum_ptr + r * n + cols, s.to(dtype), mask=mask)
    mean_sq = tl.div_rn(tl.sum(s * s, axis=0), n.to(tl.float32))
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0)
    out = rounded(s * inv_sqrt(mean_sq + eps) * scale, dtype)
    tl.store(out_ptr + r * n + cols, out.to(dtype), mask=mask)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_torch's contract: h, x [T, n] or [T, H, n] (last dim contiguous), scale [n]
    fp32; (h + x, norm) new and contiguous, in h's dtype; x None: (h itself, norm)."""
    n = h.shape[-1]
    heads, h_row, h_head = row_strides(h)
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    total = torch.empty(h.shape, dtype=h.dtype, device=h.device) if x is not None else h
    x_row = x_head = 0
    if x is not None:
        if x.shape != h.shape:
            raise ValueError(f"h and x differ in shape: {tuple(h.shape)} and {tuple(x.shape)}")
        _, x_row, x_head = row_strides(x)
    rows = h.numel() // n
    if rows:
        block = triton.next_power_of_2(n)
        _kernel[(rows,)](h, h if x is None else x, scale, total, out, n, heads, h_row, h_head, x_row, x_head, eps,
                         HAS_X=x is not None, BLOCK=block, **launch_options(block))
    return total, out

"""Elementwise and row-wise work over many rows, done a block of rows at a time.

A prefill's norms, conv and activation are a few passes each over [rows, width] tensors, several
of them fp32 temporaries: at 4096 rows those stream through memory pass after pass. Done in row
blocks whose fp32 temporaries fit in cache, the same passes read memory once, and each of these
ops measured faster that way at a long prompt (docs/measuring.md, figures behind the code's
choices). One decode row is a single block, called directly."""

from __future__ import annotations

import torch

# fp32 bytes one block's temporaries take: well inside a core's L2.
BLOCK_BYTES = 512 * 1024


def block_rows(x: torch.Tensor) -> int:
    """Rows of x per block: BLOCK_BYTES of fp32 at x's row width, at least one."""
    return max(1, BLOCK_BYTES // (4 * (x.numel() // max(1, x.shape[0]))))


def uses_row_blocks(x: torch.Tensor) -> bool:
    """Row blocks are a CPU cache measure. On CUDA or Ascend one kernel over all rows beats many
    small launches, so there the ops run whole."""
    return x.device.type == "cpu"


def by_row_blocks(fn, x: torch.Tensor, *rows_like: torch.Tensor, out_dtype: torch.dtype | None = None, row_blocks: bool = True) -> torch.Tensor:
    """fn(x, *rows_like) computed on row blocks of x (and of the tensors that share its rows)
    into one output of x's shape: the same values, since fn treats every row alone. row_blocks
    False (a device's pass shape, layers.context.PassShape, forced on a CPU): fn over all rows."""
    # A decode row (the per-token path) returns before any block arithmetic.
    if x.shape[0] == 1 or not row_blocks or not uses_row_blocks(x):
        return fn(x, *rows_like)
    step = block_rows(x)
    if x.shape[0] <= step:
        return fn(x, *rows_like)
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    for r0 in range(0, x.shape[0], step):
        rows = slice(r0, r0 + step)
        out[rows] = fn(x[rows], *(t[rows] for t in rows_like))
    return out

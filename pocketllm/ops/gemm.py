"""x @ w^T for the engine's projections. A single row (decode) goes through the one-row kernel
measured fastest for the weight's shape on this machine (pocketllm.ops.gemv), a few rows (a
decode step of several sequences) through the few-row kernel measured for that many rows, and
more rows through the many-row kernel measured for the weight's dtype (pocketllm.ops.many_rows)."""

from __future__ import annotations

import torch

from pocketllm.ops.gemv import few_rows_kernel, gemv_row
from pocketllm.ops.many_rows import gemm_rows


def linear_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in], w [out, in] -> [T, out], written into `out` when given."""
    if x.shape[0] == 1:
        if out is None:
            out = torch.empty(1, w.shape[0], dtype=x.dtype, device=x.device)
        gemv_row(x[0], w, out[0])
        return out
    kernel = few_rows_kernel(x.shape[0], w)
    if kernel is not None:
        if out is None:
            out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        kernel(x, w, out)
        return out
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    gemm_rows(x, w, out)
    return out


def linear_rows_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The plain form, same signature: what linear_rows must equal."""
    result = x @ w.t()
    if out is None:
        return result
    out.copy_(result)
    return out

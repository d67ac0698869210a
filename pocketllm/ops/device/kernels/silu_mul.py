"""SiLU-and-multiply of the MLP: silu(gate) * up, gate and up the two halves of one GEMM's output.
Rounds where silu_mul_torch does: silu(gate) to the input dtype, the product once. Elementwise, so
a row's bits do not depend on how many rows the call has."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import launch_options, rounded, silu

BLOCK = 1024


@triton.jit
def _kernel(gate_ptr, up_ptr, out_ptr, n, gate_row, up_row, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + t * gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + t * up_row + cols, mask=mask, other=0.0).to(tl.float32)
    out = rounded(rounded(silu(gate), dtype) * up, dtype)
    tl.store(out_ptr + t * n + cols, out.to(dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, n] (columns contiguous, rows at any stride): [T, n] new and contiguous."""
    if gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match, with contiguous columns")
    t, n = gate.shape
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
    if t and n:
        _kernel[(t, triton.cdiv(n, BLOCK))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=BLOCK, **launch_options(BLOCK))
    return out

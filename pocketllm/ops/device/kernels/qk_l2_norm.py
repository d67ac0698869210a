"""The Gated DeltaNet's q and k normalised to unit length per head (HF's l2norm), q then scaled by
dk**-0.5: what the gated delta rule takes. q and k are adjacent heads of the conv's output; the
torch form widens them, squares, sums, takes the root, divides and scales, a pass each.

One program per (row, head), one fixed-order reduction over the head: a row's bits do not depend
on how many rows the call has. fp32 throughout, as ops.norms.l2_normalize."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import inv_sqrt, launch_options, row_strides


@triton.jit
def _kernel(qk_ptr, q_ptr, k_ptr, n, heads, heads_q, qk_row, qk_head, q_scale, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t, j = r // heads, r % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(qk_ptr + t * qk_row + j * qk_head + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_sqrt(tl.sum(x * x, axis=0) + eps)
    heads_k = heads - heads_q
    if j < heads_q:
        tl.store(q_ptr + (t * heads_q + j) * n + cols, y * q_scale, mask=mask)
    else:
        tl.store(k_ptr + (t * heads_k + j - heads_q) * n + cols, y, mask=mask)


def qk_l2_norm(qk: torch.Tensor, heads_q: int, q_scale: float, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """qk [T, Hq + Hk, dk] (last dim contiguous): q [T, Hq, dk] normalised and times q_scale, k
    [T, Hk, dk] normalised, both new, contiguous and fp32."""
    t, heads, n = qk.shape
    _, qk_row, qk_head = row_strides(qk)
    q = torch.empty(t, heads_q, n, dtype=torch.float32, device=qk.device)
    k = torch.empty(t, heads - heads_q, n, dtype=torch.float32, device=qk.device)
    if t:
        block = triton.next_power_of_2(n)
        _kernel[(t * heads,)](qk, q, k, n, heads, heads_q, qk_row, qk_head, q_scale, eps, BLOCK=block, **launch_options(block))
    return q, k

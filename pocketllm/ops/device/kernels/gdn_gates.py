"""The Gated DeltaNet's two gates from the projection's b and a columns: beta = sigmoid(b) and the
log decay g = -exp(A_log) * softplus(a + dt_bias), both fp32. In torch that is five small kernels
(sigmoid, widen, add, softplus, multiply) over [T, Hv]; here one.

One program per row: a row's bits do not depend on how many rows the call has. Rounds where the
layer's torch form does: sigmoid(b) to b's dtype before it widens, the rest in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import launch_options, rounded


@triton.jit
def _log1p(u):
    """log(1 + u) to within a few ulps for small u too (Goldberg's correction): 1 + u rounds away
    what log then cannot see, and (1 + u) - 1 measures exactly what was kept (u itself where 1 + u
    rounds to 1)."""
    w = 1.0 + u
    kept = w == 1.0
    return tl.where(kept, u, tl.log(w) * tl.div_rn(u, tl.where(kept, 1.0, w - 1.0)))


@triton.jit
def _kernel(a_ptr, b_ptr, neg_a_ptr, dt_bias_ptr, g_ptr, beta_ptr, heads, a_row, b_row, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < heads
    b = tl.load(b_ptr + t * b_row + cols, mask=mask, other=0.0).to(tl.float32)
    beta = rounded(tl.div_rn(1.0, 1.0 + tl.exp(-b)), b_ptr.dtype.element_ty)
    x = tl.load(a_ptr + t * a_row + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's softplus (beta 1, threshold 20): x itself above the threshold.
    softplus = tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0))))
    g = tl.load(neg_a_ptr + cols, mask=mask, other=0.0) * softplus
    tl.store(g_ptr + t * heads + cols, g, mask=mask)
    tl.store(beta_ptr + t * heads + cols, beta, mask=mask)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] (columns contiguous), neg_a [Hv] fp32, dt_bias [Hv]: (g, beta) [T, Hv] fp32,
    new and contiguous."""
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"a and b need contiguous columns; got strides {tuple(a.stride())} and {tuple(b.stride())}")
    t, heads = a.shape
    g = torch.empty(t, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(t, heads, dtype=torch.float32, device=a.device)
    if t:
        block = triton.next_power_of_2(heads)
        _kernel[(t,)](a, b, neg_a, dt_bias, g, beta, heads, a.stride(0), b.stride(0), BLOCK=block, **launch_options(block))
    return g, beta

"""The GEMMs a projection of many rows (a prefill, a packed pass) may run: torch's own in the
weight's dtype, or the weight widened to fp32 a block of rows at a time into torch's fp32 GEMM.

torch's bf16/fp16 GEMM is fast where the CPU multiplies bf16 itself (AVX-512 BF16, AMX); where it
does not (an AVX2 CPU), the same call can run several times slower than the fp32 GEMM on the same
cores, and the fp32 GEMM on a widened copy is the faster way to the same fp32 sums. Which holds is
measured by the kernel registry (pocketllm.ops.registry); POCKETLLM_KERNELS=many-row=NAME forces one.
"""

from __future__ import annotations

import torch

# Weight rows widened at a time: beyond a few hundred the fp32 GEMM gains nothing, and the block's
# fp32 copy stays small.
BLOCK_ROWS = 256


def gemm_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The plain form every kernel must equal (up to fp32 summation order): fp32 products and
    sums, rounded once to out's dtype."""
    out.copy_(x.float() @ w.float().t())


def mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x, w.t(), out=out)


def mm_f32(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    xf = x.float()
    for o0 in range(0, w.shape[0], BLOCK_ROWS):
        o1 = min(o0 + BLOCK_ROWS, w.shape[0])
        out[:, o0:o1] = xf @ w[o0:o1].float().t()

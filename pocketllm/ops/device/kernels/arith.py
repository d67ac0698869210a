"""fp32 arithmetic the kernels share. Every kernel loads its inputs widened to fp32, computes in
fp32 and rounds where its torch form rounds: the interpreter computes bf16 arithmetic wrongly and
casts fp32 to bf16 by truncation, so a kernel never does arithmetic in bf16 and rounds with
`rounded`, whose bits are round-to-nearest-even on the device and under the interpreter alike.
The division and square root are the IEEE ones (div_rn, sqrt_rn), as torch's CPU forms compute
them, where the device's defaults are approximations."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE's precision (to nearest, ties to even), still fp32: storing it as
    DTYPE is then exact under any cast."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def silu(x):
    """x / (1 + exp(-x)), torch's silu, in fp32."""
    return tl.div_rn(x, 1.0 + tl.exp(-x))


@triton.jit
def inv_sqrt(x):
    """1 / sqrt(x) rounded as torch's CPU rsqrt: correctly rounded square root, then division."""
    return tl.div_rn(1.0, tl.sqrt_rn(x))


def launch_options(block: int) -> dict:
    """Launch keywords for a program over `block` elements: a warp per 256 of them (1 to 8), and
    no contraction of a multiply and an add into one fma, so the device rounds each product as the
    torch forms and the interpreter do (and as Triton's default will from 3.10 on)."""
    return {"num_warps": max(1, min(8, block // 256)), "enable_fp_fusion": False}


def row_strides(t) -> tuple[int, int, int]:
    """(heads, stride of a row, stride of a head) of t [T, n] or [T, H, n] whose last dim is
    contiguous: row r of the flattened rows is t[r // heads, r % heads]."""
    if t.stride(-1) != 1:
        raise ValueError(f"the last dim must be contiguous; got strides {tuple(t.stride())}")
    if t.dim() == 2:
        return 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"expected [T, n] or [T, H, n]; got shape {tuple(t.shape)}")

"""The Gated DeltaNet's causal depthwise conv1d + SiLU for a decode step of B sequences, each
sequence's K-1 row window read and advanced in place at its slot's row of the layer's stacked
conv state (ops.causal_conv.causal_conv1d_rows_indexed_'s contract). The torch form gathers the
windows, widens x, multiplies and adds tap by tap, shifts each window, rounds, takes the silu and
puts the windows back: a dozen kernels a GDN layer in every step, each over a few KiB. Here one
kernel reads each window once where it lies and writes it shifted.

Each output sums its K taps in fp32 in the torch form's order (the newest tap first, then oldest
to newest; no fused multiply-add), rounds once to x's dtype before the silu, and depends on no
other row. One program per (row, block of BLOCK_C channels) owns its columns of the row's
window. Rows may repeat a slot only where its result does not matter (a captured step's padding
slot): their programs then race on it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import launch_options, rounded, silu

BLOCK_C = 256


@triton.jit
def _kernel(x_ptr, taps_ptr, states_ptr, slots_ptr, out_ptr, channels, x_row, slots_step,
            K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < channels
    dtype = out_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b * slots_step).to(tl.int64)
    window = states_ptr + slot * (K - 1) * channels + cols  # row i of the slot's window: + i * channels
    x = tl.load(x_ptr + b * x_row + cols, mask=ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(taps_ptr + (K - 1) * channels + cols, mask=ok, other=0.0)
    for i in tl.static_range(K - 1):
        old = tl.load(window + i * channels, mask=ok, other=0.0).to(tl.float32)
        acc += old * tl.load(taps_ptr + i * channels + cols, mask=ok, other=0.0)
    out = rounded(silu(rounded(acc, dtype)), dtype)
    tl.store(out_ptr + b * channels + cols, out.to(dtype), mask=ok)
    # The window shifted by one row, x its newest. Row i+1 is read before row i+1 is written, by
    # the thread that handles these columns in every load and store of the program (one layout).
    for i in tl.static_range(K - 2):
        tl.store(window + i * channels, tl.load(window + (i + 1) * channels, mask=ok, other=0.0), mask=ok)
    tl.store(window + (K - 2) * channels, x, mask=ok)


def causal_conv1d_rows_indexed_(x: torch.Tensor, taps: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [B, C] (columns contiguous, rows at any stride); taps [K, C] fp32 contiguous, oldest input
    first; states [S, K-1, C] contiguous in x's dtype, each slot's window advanced in place at rows
    slots [B] (integers). Returns silu(conv(x)) [B, C] new and contiguous in x's dtype."""
    k, channels = taps.shape
    b = x.shape[0]
    if x.stride(-1) != 1 or not taps.is_contiguous() or not states.is_contiguous():
        raise ValueError("x needs contiguous columns, taps and states must be contiguous")
    if states.dim() != 3 or tuple(states.shape[1:]) != (k - 1, channels) or states.dtype != x.dtype or x.shape[-1] != channels:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, taps {tuple(taps.shape)}, states {tuple(states.shape)} {states.dtype}: "
                         f"states must be [S, K-1, C] in x's dtype")
    if k < 2:
        raise ValueError(f"the kernel takes 2 or more taps; got {k}")
    if tuple(slots.shape) != (b,) or slots.is_floating_point():
        raise ValueError(f"slots must be [B={b}] integers; got {tuple(slots.shape)} {slots.dtype}")
    out = torch.empty(b, channels, dtype=x.dtype, device=x.device)
    if b:
        _kernel[(b, triton.cdiv(channels, BLOCK_C))](x, taps, states, slots, out, channels, x.stride(0), slots.stride(0),
                                                     K=k, BLOCK_C=BLOCK_C, **launch_options(BLOCK_C))
    return out

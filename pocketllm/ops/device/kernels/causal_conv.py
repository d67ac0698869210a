"""The Gated DeltaNet's causal depthwise conv1d + SiLU over a prompt's rows, from and advancing the
K-1 row state window (ops.causal_conv.causal_conv1d_prefill_'s contract). The torch form
concatenates the state and the rows, copies the window's tail into the state, convolves and takes
the silu: four kernels and a copy of all the rows; here one kernel reads each row K times from
cache and writes the output once.

Each output sums its K taps in fp32 in the order of the CPU's blocked form and decode step (the
newest tap first, then oldest to newest), rounds once to x's dtype before the silu as conv1d does,
and depends on no other row: a row's bits do not depend on how many rows the call has.

The programs split the rows in blocks of BLOCK_T. Only the first row block reads the old state, so
its program writes the new state, after a barrier once all its threads have read the old: no
other program touches the state, and the window's tail comes from x (or, for fewer than K-1 rows,
partly from the old state that program has read)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import launch_options, rounded, silu

BLOCK_T = 16
BLOCK_C = 256


@triton.jit
def _window(x_ptr, state_ptr, w, cols, channels, x_row, rows, KM1: tl.constexpr):
    """Rows w of the window [state; x] (w < K-1: the state) at channels cols, as fp32, w [R, 1]."""
    in_state = w < KM1
    in_x = (w >= KM1) & (w < rows + KM1)
    col_ok = cols < channels
    from_state = tl.load(state_ptr + w * channels + cols, mask=in_state & col_ok, other=0.0)
    from_x = tl.load(x_ptr + (w - KM1) * x_row + cols, mask=in_x & col_ok, other=0.0)
    return tl.where(in_state, from_state.to(tl.float32), from_x.to(tl.float32))


@triton.jit
def _kernel(x_ptr, taps_ptr, state_ptr, out_ptr, rows, channels, x_row,
            K: tl.constexpr, KM1_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_t = tl.program_id(0)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]  # [BLOCK_T, 1]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BLOCK_C]
    col_ok = cols < channels
    dtype = out_ptr.dtype.element_ty
    # Output row t reads window rows t .. t+K-1; window row K-1+t is x's row t.
    acc = _window(x_ptr, state_ptr, t + (K - 1), cols, channels, x_row, rows, K - 1) \
        * tl.load(taps_ptr + (K - 1) * channels + cols, mask=col_ok, other=0.0)
    for i in tl.static_range(K - 1):
        acc += _window(x_ptr, state_ptr, t + i, cols, channels, x_row, rows, K - 1) \
            * tl.load(taps_ptr + i * channels + cols, mask=col_ok, other=0.0)
    out = rounded(silu(rounded(acc, dtype)), dtype)
    tl.store(out_ptr + t * channels + cols, out.to(dtype), mask=(t < rows) & col_ok)
    if pid_t == 0:
        # The new state: window rows rows .. rows+K-2, read before the barrier.
        j = tl.arange(0, KM1_BLOCK).to(tl.int64)[:, None]
        tail = _window(x_ptr, state_ptr, rows + j, cols, channels, x_row, rows, K - 1)
        tl.debug_barrier()
        tl.store(state_ptr + j * channels + cols, tail.to(dtype), mask=(j < K - 1) & col_ok)


def causal_conv1d_prefill_(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x [T, C] (columns contiguous, rows at any stride); taps [K, C] fp32 contiguous, oldest input
    first; state [K-1, C] contiguous in x's dtype, advanced in place. Returns silu(conv(x)) [T, C]
    new and contiguous in x's dtype."""
    k, channels = taps.shape
    if x.stride(-1) != 1 or not taps.is_contiguous() or not state.is_contiguous():
        raise ValueError("x needs contiguous columns, taps and state must be contiguous")
    if state.shape != (k - 1, channels) or state.dtype != x.dtype or x.shape[-1] != channels:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, taps {tuple(taps.shape)}, state {tuple(state.shape)} {state.dtype}: "
                         f"state must be [K-1, C] in x's dtype")
    # K-1 <= BLOCK_T: only the first row block reads the state.
    if not 1 < k <= BLOCK_T + 1:
        raise ValueError(f"the kernel takes 2 to {BLOCK_T + 1} taps; got {k}")
    rows = x.shape[0]
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_T), triton.cdiv(channels, BLOCK_C))
        _kernel[grid](x, taps, state, out, rows, channels, x.stride(0), K=k, KM1_BLOCK=triton.next_power_of_2(k - 1),
                      BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, **launch_options(BLOCK_T * BLOCK_C))
    return out

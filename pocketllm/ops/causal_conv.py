"""Depthwise causal conv1d + SiLU over a rolling window of the last K-1 inputs (the conv state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops.row_blocks import block_rows, uses_row_blocks


def causal_conv1d_prefill_(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor, row_blocks: bool = True) -> torch.Tensor:
    """x [T, C]; taps [K, C] fp32 (the conv weight, one row per tap, oldest input first); state
    [K-1, C] holds the inputs before x and is advanced in place. Returns silu(conv(x)) [T, C] in
    x's dtype, the conv summed in fp32 and rounded once before the silu, as conv1d does.
    row_blocks False (a device's pass shape, forced on a CPU): conv1d whole, as on a device."""
    k = taps.shape[0]
    window = torch.cat((state.to(x.dtype), x), dim=0)  # [T+K-1, C]
    state.copy_(window[window.shape[0] - (k - 1) :])
    # On a CPU the conv is K shifted multiply-adds over row blocks, each into an fp32 block that
    # stays in cache, at every length: torch's CPU conv1d was at best level with them and at most
    # lengths far slower, on every machine measured (docs/measuring.md, figures behind the code's
    # choices). A device runs conv1d as one kernel.
    if row_blocks and uses_row_blocks(x):
        return _conv_silu_blocked(window, taps, x.shape[0])
    weight = taps.t().to(x.dtype).unsqueeze(1)  # [C, 1, K], exact: the taps came from x's dtype
    out = F.conv1d(window.t().unsqueeze(0), weight, groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out.t())


def _conv_silu_blocked(window: torch.Tensor, taps: torch.Tensor, t: int) -> torch.Tensor:
    """silu of the depthwise conv of window [T+K-1, C] by taps [K, C], a block of rows at a time:
    each tap is one fused multiply-add into an fp32 accumulator that stays in cache."""
    k, c = taps.shape
    out = torch.empty(t, c, dtype=window.dtype, device=window.device)
    step = block_rows(window)
    acc_buf = torch.empty(min(step, t), c, dtype=torch.float32, device=window.device)
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        acc = acc_buf[: r1 - r0]
        torch.mul(window[r0 + k - 1 : r1 + k - 1], taps[k - 1], out=acc)
        for i in range(k - 1):
            acc.addcmul_(window[r0 + i : r1 + i], taps[i])
        out[r0:r1] = F.silu(acc.to(window.dtype))
    return out


def causal_conv1d_step_(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token: x [1, C]. Sums in fp32 in the blocked prefill's order, so a decoded token gets
    the bits a prefill would give it. Shifts the state in place, allocating nothing state-sized.
    One sequence's case of causal_conv1d_rows_step_."""
    return causal_conv1d_rows_step_(x, taps, state[None])


def causal_conv1d_rows_step_(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: x [B, C], state [B, K-1, C] (each row its sequence's
    window, shifted in place): the same ops on every row, what a step of several sequences runs."""
    k = taps.shape[0]
    out = x.float() * taps[k - 1]
    for i in range(k - 1):
        out.addcmul_(state[:, i], taps[i])
    for i in range(k - 2):
        state[:, i].copy_(state[:, i + 1])
    state[:, k - 2].copy_(x)
    return F.silu(out.to(x.dtype))


def causal_conv1d_rows_indexed_(x: torch.Tensor, taps: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences whose windows are rows `slots` [B] of a layer's stacked
    conv state states [S, K-1, C]: gathered, advanced by causal_conv1d_rows_step_ and put back.
    What a decode step of several sequences runs (on CUDA one kernel, ops/device)."""
    window = states[slots]
    out = causal_conv1d_rows_step_(x, taps, window)
    states.index_copy_(0, slots, window)
    return out


def causal_conv1d_reference(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The conv as its definition, in float64, with the same signature: out[t] = silu(sum_i
    taps[i] * window[t + i]) over the window of the K-1 inputs before x and x itself."""
    k = taps.shape[0]
    window = torch.cat((state.to(x.dtype), x), dim=0).double()
    state.copy_(window[window.shape[0] - (k - 1) :])
    conv = sum(window[i : i + x.shape[0]] * taps[i].double() for i in range(k))
    return F.silu(conv.to(x.dtype))

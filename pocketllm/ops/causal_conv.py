"""Depthwise causal conv1d + SiLU over a rolling window of the last K-1 inputs (the conv state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill_(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x [T, C]; weight [C, K]; state [K-1, C] holds the inputs before x and is advanced in place.
    Returns silu(conv(x)) [T, C]."""
    k = weight.shape[1]
    window = torch.cat((state.to(x.dtype), x), dim=0)  # [T+K-1, C]
    state.copy_(window[window.shape[0] - (k - 1) :])
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out.t())


def causal_conv1d_step_(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token: x [1, C]. Shifts the state in place row by row, allocating nothing state-sized."""
    k = weight.shape[1]
    out = x[0] * weight[:, k - 1]
    for i in range(k - 1):
        out.addcmul_(state[i], weight[:, i])
    for i in range(k - 2):
        state[i].copy_(state[i + 1])
    state[k - 2].copy_(x[0])
    return F.silu(out).unsqueeze(0)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference with the same signature and results as the prefill form."""
    outs = [causal_conv1d_step_(x[t : t + 1], weight, state) for t in range(x.shape[0])]
    return torch.cat(outs, dim=0)

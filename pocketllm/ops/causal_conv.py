"""Depthwise causal conv1d + SiLU over a rolling window of the last K-1 inputs (the conv state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops.row_blocks import BLOCK_BYTES, blocks_pay_off

# From this many tokens the prefill conv runs as K shifted multiply-adds over row blocks instead of
# one F.conv1d: at 4096 tokens of 2048 channels that measured 26 ms against 60 ms in bf16 (41
# against 112 in fp32), while at 512 tokens conv1d was as fast or faster in bf16. CPU only.
BLOCKED_FROM_TOKENS = 1024


def causal_conv1d_prefill_(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x [T, C]; weight [C, K]; state [K-1, C] holds the inputs before x and is advanced in place.
    Returns silu(conv(x)) [T, C]."""
    k = weight.shape[1]
    window = torch.cat((state.to(x.dtype), x), dim=0)  # [T+K-1, C]
    state.copy_(window[window.shape[0] - (k - 1) :])
    if x.shape[0] >= BLOCKED_FROM_TOKENS and blocks_pay_off(x):
        return _conv_silu_blocked(window, weight, x.shape[0])
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out.t())


def _conv_silu_blocked(window: torch.Tensor, weight: torch.Tensor, t: int) -> torch.Tensor:
    """silu of the depthwise conv of window [T+K-1, C] by weight [C, K], a block of rows at a
    time: each tap is one fused multiply-add into an fp32 accumulator that stays in cache. Rounded
    to the input dtype before the silu, where conv1d rounds."""
    k, c = weight.shape[1], weight.shape[0]
    taps = weight.t().float()  # [K, C]
    out = torch.empty(t, c, dtype=window.dtype, device=window.device)
    step = max(1, BLOCK_BYTES // (4 * c))
    acc_buf = torch.empty(min(step, t), c, dtype=torch.float32, device=window.device)
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        acc = acc_buf[: r1 - r0]
        torch.mul(window[r0 + k - 1 : r1 + k - 1], taps[k - 1], out=acc)
        for i in range(k - 1):
            acc.addcmul_(window[r0 + i : r1 + i], taps[i])
        out[r0:r1] = F.silu(acc.to(window.dtype))
    return out


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

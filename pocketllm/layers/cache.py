"""Per-layer decode state, allocated once for the run's length: the GDN conv window and fp32
recurrent state, and a preallocated KV cache for the full-attention layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GDNState:
    conv: torch.Tensor  # [K-1, C_local], the last K-1 conv inputs, oldest first
    recurrent: torch.Tensor  # [Hv_local, Dk, Dv] fp32


@dataclass
class KVCache:
    k: torch.Tensor  # [Hkv_local, max_len, D]
    v: torch.Tensor


def allocate_states(model, max_len: int) -> list:
    """One state object per layer, shaped by that layer's own local sizes."""
    return [layer.mixer.allocate_state(max_len) for layer in model.layers]


def reset_states(states: list) -> None:
    for s in states:
        if isinstance(s, GDNState):
            s.conv.zero_()
            s.recurrent.zero_()

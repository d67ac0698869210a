"""The two RMSNorms of this model as layers that load their weight: zero-centred (weight stored as
w, applied as 1 + w) and the GDN's gated norm (plain weight, times silu(z)); the arithmetic is in
pocketllm.ops.norms."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm.layers.sharding import ShardSource, read_all, sharded_param
from pocketllm.ops.norms import rms_norm_gated, rms_norm_scaled


class RMSNorm(nn.Module):
    def __init__(self, key: str, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = sharded_param((dim,), [ShardSource(key, (dim,), read_all)], dtype, device)

        self.scale: torch.Tensor | None = None

    def after_loading(self) -> None:
        # 1 + w in fp32: the weight never changes after loading.
        self.scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm takes a None scale as "no scale": fail instead of silently dropping 1 + w.
        if self.scale is None:
            raise RuntimeError("RMSNorm used before after_loading(): its fp32 scale is not made yet")
        return rms_norm_scaled(x, self.scale, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, key: str, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = sharded_param((dim,), [ShardSource(key, (dim,), read_all)], dtype, device)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, z, self.weight, self.eps)

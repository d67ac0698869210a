"""Column-parallel (fused, split by heads) and row-parallel linear layers. Each runs its weight
through `self.kernels`, the kernels the engine bound it to (pocketllm.ops.registry; each kind's
default until then)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pocketllm.distributed.overlap import projection_all_reduce_overlapped
from pocketllm.distributed.state import tp
from pocketllm.layers.sharding import (
    RowRange,
    ShardSource,
    read_cols,
    row_sources,
    sharded_param,
)
from pocketllm.ops.registry import default_kernels


class ColumnParallelLinear(nn.Module):
    """One GEMM over the stacked rows this rank owns of one or more checkpoint weights; the
    caller splits the output. `parts` is (checkpoint key, full [out, in] shape, row ranges)."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, tuple[int, int], Sequence[RowRange]]], dtype, device):
        super().__init__()
        rows, sources = row_sources(parts)
        self.weight = sharded_param((rows, in_features), sources, dtype, device)
        self.part_sizes = [s.dest[1] - s.dest[0] for s in sources]
        self.kernels = default_kernels(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels(x)


class RowParallelLinear(nn.Module):
    """x [T, in_local] -> [T, out], summed over ranks by the overlapped projection at `site`."""

    def __init__(self, key: str, in_features: int, out_features: int, site: str, dtype, device):
        super().__init__()
        world, rank = tp().world, tp().rank
        local = in_features // world
        self.site = site
        source = ShardSource(key, (out_features, in_features), read_cols(rank * local, (rank + 1) * local))
        self.weight = sharded_param((out_features, local), [source], dtype, device)
        self.kernels = default_kernels(self.weight)

    def forward(self, x: torch.Tensor, slices: int) -> torch.Tensor:
        return projection_all_reduce_overlapped(x, self.kernels, slices, self.site)

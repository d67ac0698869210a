"""Column-parallel (fused, split by heads) and row-parallel linear layers. A weight is a float
parameter, or a QuantizedWeight where the run's weight plan quantizes its checkpoint tensor. Each
runs its weight through `self.kernels`, the kernels the engine bound it to (pocketllm.ops.registry;
each kind's default until then), part by part of the pass (layers.context.Part): a run of decode
rows with each row summed as it is alone, a prompt segment in a call of its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pocketllm.distributed.overlap import projection_all_reduce_overlapped
from pocketllm.distributed.state import tp
from pocketllm.layers.context import ForwardContext, Part as RowPart
from pocketllm.layers.sharding import (
    QuantSource,
    RowRange,
    ShardSource,
    quantized_param,
    read_cols,
    row_sources,
    sharded_param,
)
from pocketllm.ops.registry import default_kernels
from pocketllm.quantization import WeightPlan

Part = tuple[str, tuple[int, int], Sequence[RowRange]]


def _scheme(plan: WeightPlan | None, key: str):
    return None if plan is None else plan.scheme_for(key)


def _runs(parts: Sequence[Part], plan: WeightPlan | None) -> list[list[Part]]:
    """Consecutive parts held alike (the same scheme, or float), grouped."""
    runs: list[tuple[object, list[Part]]] = []
    for part in parts:
        scheme = _scheme(plan, part[0])
        if runs and runs[-1][0] == scheme:
            runs[-1][1].append(part)
        else:
            runs.append((scheme, [part]))
    return [block for _, block in runs]


def project(kernels, x: torch.Tensor, parts: Sequence[RowPart] | None) -> torch.Tensor:
    """x [T, in] through bound kernels, one call per part (None: one call by row count)."""
    if parts is None:
        return kernels(x)
    if len(parts) == 1:
        return parts[0].kernel(kernels)(x)
    out = torch.empty(x.shape[0], kernels.out_features, dtype=x.dtype, device=x.device)
    for p in parts:
        p.kernel(kernels)(x[p.rows], out[p.rows])
    return out


class ColumnParallelLinear(nn.Module):
    """One GEMM over the stacked rows this rank owns of one or more checkpoint weights; the
    caller splits the output. `parts` is (checkpoint key, full [out, in] shape, row ranges).

    Parts held alike share one weight. A checkpoint that quantized some parts of a fused
    projection and not others (an ignore list) makes one child layer of this class per run of
    alike parts (`blocks`), each with its own weight and bound kernels, and the outputs are
    concatenated: every layer with a `weight` runs one weight through one set of kernels."""

    def __init__(self, in_features: int, parts: Sequence[Part], dtype, device, plan: WeightPlan | None = None):
        super().__init__()
        rows, sources = row_sources(parts)
        self.part_sizes = [s.dest[1] - s.dest[0] for s in sources]
        runs = _runs(parts, plan)
        if len(runs) > 1:
            self.blocks = nn.ModuleList(ColumnParallelLinear(in_features, block, dtype, device, plan) for block in runs)
            return
        self.blocks = None
        scheme = _scheme(plan, parts[0][0])
        if scheme is None:
            self.weight = sharded_param((rows, in_features), sources, dtype, device)
        else:
            quant = [QuantSource(key, tuple(shape), tuple(ranges), None, src.dest) for (key, shape, ranges), src in zip(parts, sources)]
            self.weight = quantized_param((rows, in_features), scheme, quant, dtype, device)
        self.kernels = default_kernels(self.weight)

    def after_loading(self) -> None:
        # The loader may have replaced a quantized weight (by its dequantized values on a device).
        if self.blocks is None:
            self.kernels = default_kernels(self.weight)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        if self.blocks is None:
            return project(self.kernels, x, None if ctx is None else ctx.parts)
        return torch.cat([b(x, ctx) for b in self.blocks], dim=-1)


class RowParallelLinear(nn.Module):
    """x [T, in_local] -> [T, out], summed over ranks by the overlapped projection at `site`."""

    blocks = None

    def __init__(self, key: str, in_features: int, out_features: int, site: str, dtype, device, plan: WeightPlan | None = None):
        super().__init__()
        world, rank = tp().world, tp().rank
        local = in_features // world
        self.site = site
        cols = (rank * local, (rank + 1) * local)
        scheme = _scheme(plan, key)
        if scheme is None:
            source = ShardSource(key, (out_features, in_features), read_cols(*cols))
            self.weight = sharded_param((out_features, local), [source], dtype, device)
        else:
            source = QuantSource(key, (out_features, in_features), None, cols, (0, out_features))
            self.weight = quantized_param((out_features, local), scheme, [source], dtype, device)
        self.kernels = default_kernels(self.weight)

    def after_loading(self) -> None:
        self.kernels = default_kernels(self.weight)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return projection_all_reduce_overlapped(x, self.kernels, ctx.slices, self.site, ctx.parts)

"""What a parameter is loaded from: one or more checkpoint tensors, and which part of each belongs
to this rank. A `ShardSource` reads through a safetensors slice, so a rank reads only its own part;
a `QuantSource` does the same for a projection weight held quantized."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pocketllm import host_memory
from pocketllm.ops.quant.layout import QuantizedWeight
from pocketllm.quantization import WeightScheme

RowRange = tuple[int, int]


@dataclass(frozen=True)
class ShardSource:
    key: str
    full_shape: tuple[int, ...]
    read: Callable[[Any], torch.Tensor]
    # First-dim rows of the parameter this source fills; None fills the whole parameter.
    dest: RowRange | None = None


def read_rows(ranges: Sequence[RowRange]) -> Callable[[Any], torch.Tensor]:
    """Rows [a, b) of dim 0 for each range, concatenated (q/k/v segments of a fused projection)."""
    ranges = [r for r in ranges if r[1] > r[0]]

    def read(sl):
        parts = [sl[a:b] for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    return read


def read_cols(start: int, end: int) -> Callable[[Any], torch.Tensor]:
    return lambda sl: sl[:, start:end]


def read_all(sl) -> torch.Tensor:
    return sl[:]


def split_range(total: int, rank: int, world: int) -> RowRange:
    size = total // world
    return rank * size, (rank + 1) * size


def sharded_param(shape: Sequence[int], sources: Sequence[ShardSource], dtype: torch.dtype, device) -> nn.Parameter:
    param = nn.Parameter(host_memory.zeros(shape, dtype, device), requires_grad=False)
    param.sources = list(sources)
    return param


def row_sources(key_and_ranges: Sequence[tuple[str, tuple[int, ...], Sequence[RowRange]]]) -> tuple[int, list[ShardSource]]:
    """Stack the row ranges of several checkpoint tensors into one parameter (a fused GEMM).
    Returns the stacked row count and the sources that fill it in order."""
    sources, offset = [], 0
    for key, full_shape, ranges in key_and_ranges:
        rows = sum(b - a for a, b in ranges)
        sources.append(ShardSource(key, tuple(full_shape), read_rows(ranges), (offset, offset + rows)))
        offset += rows
    return offset, sources


@dataclass(frozen=True)
class QuantSource:
    """Part of a quantized projection weight: rows `rows` (every column) or columns `cols` (every
    row) of checkpoint weight `key` [out, in], filling rows `dest` of the weight. The whole
    matrix's quantization is sliced, never the slice quantized afresh (pocketllm.loader.quantized)."""

    key: str
    full_shape: tuple[int, int]
    rows: tuple[RowRange, ...] | None
    cols: RowRange | None
    dest: RowRange


def quantized_param(shape: Sequence[int], scheme: WeightScheme, sources: Sequence[QuantSource], dtype, device) -> QuantizedWeight:
    """An empty quantized weight [out, in] of `scheme`, on the host (the loader fills it; its
    scales, and zero points if any, take the dtype the checkpoint gives them). On another device
    the loader replaces it with its dequantized values in `dtype` there."""
    out, cols = shape
    per_byte = 2 if scheme.bits == 4 else 1
    group = scheme.group if scheme.bits == 4 else cols
    stored = torch.uint8 if scheme.bits == 4 else torch.int8
    qw = QuantizedWeight(scheme.kind, group, host_memory.zeros((out, cols // per_byte), stored), torch.zeros(out, cols // group))
    qw.sources = list(sources)
    qw.plan = scheme
    qw.target = (dtype, torch.device(device))
    return qw

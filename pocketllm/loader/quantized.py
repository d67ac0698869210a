"""Quantized projection weights at load (the weight plan and its split are checked first, by
pocketllm/loader/checks.py): each rank's part of a whole matrix's quantization, read from the checkpoint's packed tensors or made
here from the float (or fp8) weights it reads.

A rank reads only its slice of the source tensor. A column-parallel shard holds whole rows and an
int4 row-parallel shard whole groups, so quantizing the slice gives exactly the slice of the
whole matrix's quantization. An int8 row-parallel shard's rows scale by the maximum over the whole
row: the ranks agree on it with one all-reduce (max) per weight at load."""

from __future__ import annotations

import torch

from pocketllm.distributed.state import all_reduce_max
from pocketllm.errors import CheckpointError
from pocketllm.loader.compressed_tensors import read_packed
from pocketllm.ops.quant.layout import QuantizedWeight, dequantize, quantize
from pocketllm.quantization import WeightScheme


def read_quantized(source, key: str, full_shape: tuple[int, int], rows, cols, scheme: WeightScheme) -> QuantizedWeight:
    """This rank's part of weight `key` (rows `rows`, or columns `cols`) in `scheme`."""
    if getattr(source, "has", None) and source.has(key + "_packed"):
        return read_packed(source, key, scheme, rows, cols)
    sl = source.get_slice(key)
    row_max = None
    if rows is not None:
        parts = [sl[a:b] for a, b in rows if b > a]
        w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    else:
        w = sl[:, cols[0] : cols[1]]
        if scheme.bits == 8 and cols != (0, full_shape[1]):
            row_max = all_reduce_max(w.float().abs().amax(dim=1))
    scale_dtype = getattr(sl, "scale_dtype", None) or w.dtype
    return quantize(w, scheme.kind, scheme.group, scheme.symmetric, scale_dtype=scale_dtype, row_max=row_max)


def fill_quantized(qw: QuantizedWeight, source) -> int:
    """Fill an empty quantized weight (pocketllm.layers.sharding.quantized_param) from its
    sources; returns the bytes it holds."""
    for src in qw.sources:
        part = read_quantized(source, src.key, src.full_shape, src.rows, src.cols, qw.plan)
        d0, d1 = src.dest
        if part.qweight.shape != qw.qweight[d0:d1].shape or part.group != qw.group:
            raise CheckpointError(f"{src.key}: read {list(part.qweight.shape)} (group {part.group}), the weight holds {list(qw.qweight[d0:d1].shape)} (group {qw.group})")
        if qw.scales.dtype != part.scales.dtype:
            qw.scales = torch.zeros(qw.scales.shape, dtype=part.scales.dtype)
        if part.zeros is not None and qw.zeros is None:
            qw.zeros = torch.zeros(qw.scales.shape, dtype=torch.uint8)
        qw.qweight[d0:d1] = part.qweight
        qw.scales[d0:d1] = part.scales
        if part.zeros is not None:
            qw.zeros[d0:d1] = part.zeros
    return qw.nbytes


# Output rows dequantized at a time on a device: the fp32 temporary stays small beside the weight
# (a whole 27B vocabulary head in fp32 would be 4.7 GiB).
DEQUANTIZE_ROWS = 4096


def for_device(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    """What a filled weight runs as on `device`: itself on a CPU, where the quantized kernels
    are; elsewhere its dequantized values in the run's dtype (the same numbers, not the bytes)."""
    if device.type == "cpu":
        return qw
    if device.type == "npu":
        # An NPU has not run these unpacking ops yet: widened on the host, as before, and moved.
        return dequantize(qw).to(dtype).to(device)
    return dequantized_on(qw, dtype, device)


def dequantized_on(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """dequantize(qw) in `dtype` on `device`, widened there from the stored bytes a block of rows
    at a time: the host sends a quarter (int8) or an eighth (int4) of the fp32 matrix's bytes and
    never holds a float copy of it."""
    zeros = None if qw.zeros is None else qw.zeros.to(device)
    moved = QuantizedWeight(qw.scheme, qw.group, qw.qweight.to(device), qw.scales.to(device), zeros)
    out = torch.empty(qw.shape, dtype=dtype, device=device)
    for r0 in range(0, out.shape[0], DEQUANTIZE_ROWS):
        r1 = min(r0 + DEQUANTIZE_ROWS, out.shape[0])
        out[r0:r1] = dequantize(moved.rows(r0, r1))
    return out

"""The row-wise work of a pass (a norm with its residual add, SiLU-and-multiply) part by part
(layers.context.Part): a part of decode rows in the one-row forms, each row getting the bits it
gets alone (the compiled ops row by row where they apply, else the torch forms row by row), a
prompt segment's rows in the compiled rows forms split over the threads where they apply, else the
torch forms by row blocks. One part of one row is a decode step
alone; one part of many rows, a prefill alone. A part without cpu_forms (a device's pass,
layers.context.PassShape) takes the device's forms (ops/device: Triton kernels on CUDA) over all
its rows at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pocketllm.layers.context import Part
from pocketllm.ops.fused import DecodeOps
from pocketllm.ops.fused import kernels as fused_kernels
from pocketllm.ops.rowwise import add_rms_norm_torch, silu_mul_torch
from pocketllm.ops.row_blocks import by_row_blocks


def _each_row(op, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """op on each row alone (a torch form whose rows might round differently in a bigger call)."""
    outs = [op(*(t if t is None else t[i : i + 1] for t in tensors)) for i in range(tensors[0].shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(col) for col in zip(*outs))
    return torch.cat(outs)


def add_rms_norm(ops: DecodeOps, part: Part, h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float):
    """(h + x, rms_norm(h + x) * scale) on one part's rows h, x (x None: no add)."""
    rows = h.shape[0]
    if not part.cpu_forms:
        # A device's pass: one call over all the part's rows (a Triton kernel on CUDA).
        return ops.device.add_rms_norm(h, x, scale, eps)
    if not part.alone:
        # A prompt segment's rows: the compiled rows form splits them over the threads (it treats
        # every row alone, so a row's bits do not depend on the segment's other rows either).
        if ops.compiled and rows > 1:
            return fused_kernels.add_rms_norm_rows(h.contiguous(), None if x is None else x.contiguous(), scale, eps)
        return add_rms_norm_torch(h, x, scale, eps)
    if rows == 1:
        return ops.add_rms_norm(h, x, scale, eps)
    if ops.compiled:
        return fused_kernels.add_rms_norm_rows(h.contiguous(), None if x is None else x.contiguous(), scale, eps)
    h_out, y = _each_row(lambda hr, xr: ops.add_rms_norm(hr, xr, scale, eps), h, x)
    return (h if x is None else h_out), y


def silu_mul(ops: DecodeOps, part: Part, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not part.cpu_forms:
        return ops.device.silu_mul(gate, up)
    if not part.alone:
        if ops.compiled and gate.shape[0] > 1:
            return fused_kernels.silu_mul_rows(gate, up)
        return by_row_blocks(silu_mul_torch, gate, up)
    if gate.shape[0] == 1:
        return ops.silu_mul(gate, up)
    if ops.compiled:
        return fused_kernels.silu_mul_rows(gate, up)
    return _each_row(ops.silu_mul, gate, up)


def add_rms_norm_parts(ops: DecodeOps, parts: Sequence[Part], h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float):
    """add_rms_norm over a pass's rows, part by part."""
    if len(parts) == 1:
        return add_rms_norm(ops, parts[0], h, x, scale, eps)
    h_out = h if x is None else torch.empty_like(h)
    y = torch.empty_like(h)
    for p in parts:
        hp, yp = add_rms_norm(ops, p, h[p.rows], None if x is None else x[p.rows], scale, eps)
        if x is not None:
            h_out[p.rows] = hp
        y[p.rows] = yp
    return h_out, y


def silu_mul_parts(ops: DecodeOps, parts: Sequence[Part], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over a pass's rows, part by part."""
    if len(parts) == 1:
        return silu_mul(ops, parts[0], gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    for p in parts:
        out[p.rows] = silu_mul(ops, p, gate[p.rows], up[p.rows])
    return out

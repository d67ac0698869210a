"""torch's own weight-only quantized matmuls as candidates: `torch._weight_int8pack_mm` (int8
[out, in] with one scale per row: the layout as loaded) and `aten._weight_int4pack_mm_for_cpu`
(its own packed int4 layout, made by `_convert_weight_to_int4pack_for_cpu`); and the plain torch
form every quantized kind falls back to (quant_linear_torch: the weight dequantized to fp32 a block
of rows at a time, torch's fp32 GEMM), which runs anywhere torch does.

Both take their scales in the activations' dtype, so `prepare` keeps an fp32 copy (exact for every
stored dtype) and each call uses it converted to x's dtype, made once per dtype. Scales that are
not bf16 are then rounded for bf16 activations, and the int4 op's zero point, a float added after
the scale ((q - 8) * scale + zero), holds (8 - z) * scale rounded: both are rounding of the weight
beyond the reference's, bounded by the tests and reported in docs/quantization.md.

The int4 layout packs blocks of 64 weight rows, so the prepared weight is padded to a multiple of 64
rows (zero scales) and the padding's outputs are dropped.
"""

from __future__ import annotations

import torch

from pocketllm.ops.quant.layout import QuantizedWeight, dequantize, unpack_int4

# Weight rows converted to torch's int4 layout at a time: the conversion takes int32 values, 4
# bytes per weight, so a whole 248k-row head at once would need gigabytes.
CONVERT_ROWS = 1024
# quant_linear_torch dequantizes to fp32 this many output rows at a time, so its temporary stays
# small beside the weight (a 27B head is 5 GB in fp32).
DEQUANT_ROWS = 1024
PACK_ROWS = 64
# torch._weight_int8pack_mm reads a row's inputs this many at a time.
INT8_INPUT_STEP = 16


class _Scaled:
    """Per-dtype copies of an fp32 tensor, made on first use."""

    def __init__(self, master: torch.Tensor):
        self.master = master
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {torch.float32: master}

    def get(self, dtype: torch.dtype) -> torch.Tensor:
        t = self.by_dtype.get(dtype)
        if t is None:
            t = self.by_dtype[dtype] = self.master.to(dtype).contiguous()
        return t


class Int8Pack:
    """An int8 weight as torch's op takes it: the values as loaded, scales [out]."""

    def __init__(self, qw: QuantizedWeight):
        if qw.scheme != "int8":
            raise ValueError(f"torch's int8 op takes int8 weights, got {qw.scheme}")
        self.out_features, self.in_features = qw.shape
        if self.in_features % INT8_INPUT_STEP:
            # torch 2.13's CPU kernel reads past such rows (wrong sums, or a crash).
            raise ValueError(f"torch's int8 op needs a multiple of {INT8_INPUT_STEP} inputs, not {self.in_features}")
        self.qweight = qw.qweight.contiguous()
        self.scales = _Scaled(qw.scales.float().reshape(-1).contiguous())


class Int4Pack:
    """An int4 weight in torch's packed CPU layout, with [in/group, out padded, 2] (scale, zero)."""

    def __init__(self, qw: QuantizedWeight):
        if qw.scheme != "int4":
            raise ValueError(f"torch's int4 op takes int4 weights, got {qw.scheme}")
        self.out_features, self.in_features = qw.shape
        self.group = qw.group
        padded = -(-self.out_features // PACK_ROWS) * PACK_ROWS
        parts = []
        for r0 in range(0, padded, CONVERT_ROWS):
            r1 = min(r0 + CONVERT_ROWS, padded)
            q = torch.full((r1 - r0, self.in_features), 8, dtype=torch.int32)
            real = max(0, min(r1, self.out_features) - r0)
            if real:
                q[:real] = unpack_int4(qw.qweight[r0 : r0 + real])
            parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        scale = torch.zeros(padded, self.in_features // self.group)
        zero = torch.zeros_like(scale)
        scale[: self.out_features] = qw.scales.float()
        if qw.zeros is not None:
            zero[: self.out_features] = (8.0 - qw.zeros.float()) * qw.scales.float()
        self.scale_zeros = _Scaled(torch.stack([scale.t(), zero.t()], dim=-1).contiguous())


def prepare_int8pack(qw: QuantizedWeight) -> Int8Pack:
    return Int8Pack(qw)


def prepare_int4pack(qw: QuantizedWeight) -> Int4Pack:
    return Int4Pack(qw)


def _check(kernel: str, x, out, in_features: int, out_features: int) -> torch.Tensor:
    """x as [rows, in], after checking x [in] / out [out] or x [m, in] / out [m, out]."""
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() not in (1, 2):
        raise ValueError(f"{kernel}: x must be a tensor [{in_features}] or [rows, {in_features}]")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or out.dtype != x.dtype:
        raise ValueError(f"{kernel}: x and out must be bfloat16, float16 or float32 alike, got {x.dtype} and {out.dtype}")
    lead = tuple(x.shape[:-1])
    if tuple(x.shape) != (*lead, in_features) or tuple(out.shape) != (*lead, out_features):
        raise ValueError(f"{kernel}: x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a weight of {out_features}x{in_features}")
    if x.device.type != "cpu" or out.device.type != "cpu":
        raise ValueError(f"{kernel}: x and out must be on the CPU")
    return x if x.dim() == 2 else x[None]


def int8pack_mm(x: torch.Tensor, w, out: torch.Tensor) -> None:
    """out = x @ W^T by torch._weight_int8pack_mm; w a QuantizedWeight or its Int8Pack."""
    if not isinstance(w, Int8Pack):
        w = Int8Pack(w)
    x2 = _check("int8pack", x, out, w.in_features, w.out_features)
    out.copy_(torch._weight_int8pack_mm(x2.contiguous(), w.qweight, w.scales.get(x.dtype)).view_as(out))


def int4pack_mm(x: torch.Tensor, w, out: torch.Tensor) -> None:
    """out = x @ W^T by aten._weight_int4pack_mm_for_cpu; w a QuantizedWeight or its Int4Pack."""
    if not isinstance(w, Int4Pack):
        w = Int4Pack(w)
    x2 = _check("int4pack", x, out, w.in_features, w.out_features)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), w.packed, w.group, w.scale_zeros.get(x.dtype))
    out.copy_(y[:, : w.out_features].view_as(out))


def quant_linear_torch(x: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> None:
    """out [m, out] = x [m, in] @ dequantize(qw)^T in fp32, rounded once to out's dtype, a block of
    DEQUANT_ROWS output rows at a time: every quantized kind's default, never timed (it
    dequantizes the weight on every call)."""
    for r0 in range(0, qw.shape[0], DEQUANT_ROWS):
        r1 = min(r0 + DEQUANT_ROWS, qw.shape[0])
        out[:, r0:r1].copy_(x.float() @ dequantize(qw.rows(r0, r1)).t())


def quant_linear_torch_one(x: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> None:
    """quant_linear_torch of one row: x [in] -> out [out]."""
    quant_linear_torch(x[None], qw, out[None])

"""How a weight-only quantized projection weight is held in memory, and its plain torch forms:
quantize, dequantize and the reference product every quantized kernel must equal.

One layout for every scheme, chosen so the checkpoint formats load without rearranging bytes:
- int8: `qweight` int8 [out, in], one scale per output row (`group` = in).
- int4: `qweight` uint8 [out, in/2], two values per byte along the row, element 2j in the low
  nibble of byte j and 2j+1 in the high nibble, each stored unsigned 0..15; its value is
  (q - zero) * scale over groups of `group` consecutive inputs. Symmetric: zero is 8 for every
  group (`zeros` None); asymmetric: `zeros` uint8 [out, in/group] in 0..15. This is the byte
  order of an int32 packing of eight nibbles, element i at bits 4i, read on a little-endian host.
- `scales` [out, in/group] in the dtype the weight came with (bf16, fp16 or fp32): a kernel that
  wants another form makes it when it prepares the weight.

A rank's shard is a slice of the whole quantized matrix: rows for a column-parallel projection,
whole groups of columns for a row-parallel one, so TP multiplies exactly the numbers TP=1 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("int8", "int4")
INT4_GROUPS = (32, 64, 128)


@dataclass
class QuantizedWeight:
    scheme: str  # "int8" or "int4"
    group: int  # inputs per scale (int8: in_features)
    qweight: torch.Tensor  # int8 [out, in] or uint8 [out, in/2]
    scales: torch.Tensor  # [out, in/group]
    zeros: torch.Tensor | None = None  # uint8 [out, in/group], asymmetric int4 only

    @property
    def shape(self) -> tuple[int, int]:
        out, cols = self.qweight.shape
        return out, cols * (2 if self.scheme == "int4" else 1)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: the values, scales and zero points."""
        parts = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def rows(self, r0: int, r1: int) -> QuantizedWeight:
        """Output rows r0:r1 (a column-parallel shard)."""
        z = None if self.zeros is None else self.zeros[r0:r1]
        return QuantizedWeight(self.scheme, self.group, self.qweight[r0:r1], self.scales[r0:r1], z)

    def cols(self, c0: int, c1: int) -> QuantizedWeight:
        """Input columns c0:c1 (a row-parallel shard); both ends must fall on group boundaries."""
        if c0 % self.group or c1 % self.group:
            raise ValueError(f"columns {c0}:{c1} do not fall on the {self.group}-input group boundaries")
        per_byte = 2 if self.scheme == "int4" else 1
        g0, g1 = c0 // self.group, c1 // self.group
        z = None if self.zeros is None else self.zeros[:, g0:g1]
        return QuantizedWeight(self.scheme, self.group, self.qweight[:, c0 // per_byte : c1 // per_byte], self.scales[:, g0:g1], z)


def quantize(
    w: torch.Tensor, scheme: str, group: int | None = None, symmetric: bool = True, scale_dtype: torch.dtype | None = None,
    row_max: torch.Tensor | None = None,
) -> QuantizedWeight:
    """w [out, in] (any float dtype) -> its quantized form. int8: symmetric, one scale per row.
    int4: groups of `group` inputs, symmetric (values -8..7 around zero 8) or asymmetric (0..15
    with a zero point per group). Scales are computed in fp32 and stored in `scale_dtype`
    (default: w's dtype); the values are rounded against the stored scale, so dequantizing
    reproduces what the kernels multiply. `row_max` (int8 only, fp32 [out]): each row's largest
    absolute value over the whole row, when w holds only some of its columns (a row-parallel
    shard), so the shard is exactly that slice of the whole row's quantization."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    out, cols = w.shape
    scale_dtype = scale_dtype or w.dtype
    tiny = torch.finfo(torch.float32).tiny
    # One fp32 copy, worked on in place, and each range from one min/max pass: the same numbers
    # as |w|'s maximum and round(w / scale), at a writer's pace over a 27B checkpoint.
    wf = w.to(torch.float32, copy=True)
    if scheme == "int8":
        group = cols
        if row_max is None:
            lo, hi = torch.aminmax(wf, dim=1, keepdim=True)
            amax = torch.maximum(hi, lo.neg_())
        else:
            amax = row_max.float().view(out, 1)
        scale = (amax / 127.0).clamp_min(tiny).to(scale_dtype)
        q = wf.div_(scale.float()).round_().clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", group, q, scale)
    group = group or 128
    if cols % group or group % 2:
        raise ValueError(f"{cols} inputs do not split into groups of {group}")
    g = wf.view(out, cols // group, group)
    lo, hi = torch.aminmax(g, dim=2)
    if symmetric:
        scale = (torch.maximum(hi, lo.neg_()) / 7.5).clamp_min(tiny).to(scale_dtype)
        q = g.div_(scale.float()[..., None]).round_().clamp_(-8, 7).add_(8)
        zeros = None
    else:
        lo.clamp_max_(0.0)
        hi.clamp_min_(0.0)
        scale = ((hi - lo) / 15.0).clamp_min(tiny).to(scale_dtype)
        zeros = torch.round(-lo / scale.float()).clamp_(0, 15)
        q = g.div_(scale.float()[..., None]).round_().add_(zeros[..., None]).clamp_(0, 15)
        zeros = zeros.to(torch.uint8)
    q = q.to(torch.uint8).view(out, cols)
    return QuantizedWeight("int4", group, pack_int4(q), scale, zeros)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [out, in] -> bytes [out, in/2], element 2j low, 2j+1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [out, in/2] -> uint8 values 0..15 [out, in]."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The fp32 matrix [out, in] the quantized weight stands for."""
    out, cols = qw.shape
    scale = qw.scales.float()
    if qw.scheme == "int8":
        return qw.qweight.float() * scale
    q = unpack_int4(qw.qweight).float().view(out, cols // qw.group, qw.group)
    zero = 8.0 if qw.zeros is None else qw.zeros.float()[..., None]
    return ((q - zero) * scale[..., None]).view(out, cols)


def quant_linear_reference(x: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> None:
    """out [T, out] = x [T, in] @ dequantize(qw)^T in fp32, rounded once to out's dtype: what
    every quantized kernel must equal up to fp32 summation order (one row: x [in], out [out])."""
    out.copy_(x.float() @ dequantize(qw).t())


# The blocks of inputs x is quantized over where a kernel multiplies int8 x (gemv_int4_int8x.c,
# gemv_int8_int8x.c).
X_BLOCK = 32


def quantize_x_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> the fp32 values an int8-x kernel multiplies: per block of X_BLOCK inputs (the
    last one padded with zeros), scale = its largest |x| / 127, each input rint(x * 127 / largest)
    times that scale, computed in fp32 as the kernel computes them."""
    n = x.shape[-1]
    xf = torch.nn.functional.pad(x.float(), (0, -n % X_BLOCK))
    xf = xf.reshape(*x.shape[:-1], xf.shape[-1] // X_BLOCK, X_BLOCK)
    big = xf.abs().amax(dim=-1, keepdim=True)
    # Divisions of two tensors: torch takes `127.0 / t` as a reciprocal times 127, which rounds
    # differently from the kernel's one division.
    c127 = torch.full_like(big, 127.0)
    inv = torch.where(big > 0, c127 / big, torch.zeros_like(big))
    return (torch.round(xf * inv) * (big / c127)).reshape(*x.shape[:-1], -1)[..., :n]


def quant_linear_int8x_reference(x: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> None:
    """quant_linear_reference with x first quantized as quantize_x_int8 does: what an int8-x kernel
    must equal up to fp32 summation order."""
    out.copy_(quantize_x_int8(x) @ dequantize(qw).t())

"""The compressed-tensors `pack-quantized` checkpoint format, as vLLM and llm-compressor read and
write it, to and from pocketllm's quantized layout (pocketllm.ops.quant.layout).

A quantized linear weight `X.weight` [out, in] is stored as:
- `X.weight_packed` int32 [out, in * bits / 32]: each value q (signed, -2^(bits-1)..2^(bits-1)-1)
  offset by 2^(bits-1) to unsigned, 32/bits of them per int32 along the row, element i of a
  word at bits i*bits. On a little-endian host those words are exactly the layout's bytes: int4
  nibbles low first, and int8 values as unsigned bytes (the layout's int8 with the top bit flipped).
- `X.weight_scale` [out, in / group] (int8: [out, 1]) in the model's dtype.
- `X.weight_shape` int64 [2]: the original [out, in].
- asymmetric only, `X.weight_zero_point` int32 [ceil(out * bits / 32), in / group]: the signed
  zero points offset to unsigned and packed the same way but along the output rows (dim 0).
  Older writers stored them unpacked, int8 [out, in / group]; both are read.
The signed value's dequantized form is (q - z) * scale: the layout's unsigned q and zero are
q + 8 and z + 8, so the same numbers.
"""

from __future__ import annotations

import torch

from pocketllm.ops.quant.layout import QuantizedWeight
from pocketllm.loader.formats import check_host
from pocketllm.quantization import WeightScheme

def _rows(sl, ranges) -> torch.Tensor:
    parts = [sl[a:b] for a, b in ranges if b > a]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def read_packed(source, key: str, scheme: WeightScheme, rows, cols) -> QuantizedWeight:
    """Rows `rows` (ranges, every column) or columns `cols` (one range, every row) of packed
    weight `key`, as the layout holds them: the slice of the whole matrix's quantization. Reads
    only that part of each tensor (the zero points' packed words round out to whole words)."""
    per_word = 32 // scheme.bits
    packed = source.get_slice(key + "_packed")
    scale = source.get_slice(key + "_scale")
    if rows is not None:
        q, s = _rows(packed, rows), _rows(scale, rows)
    else:
        c0, c1 = cols
        q = packed[:, c0 // per_word : c1 // per_word]
        s = scale[:] if scheme.bits == 8 else scale[:, c0 // scheme.group : c1 // scheme.group]
    q = q.contiguous().view(torch.uint8)
    if scheme.bits == 8:
        q = (q ^ 0x80).view(torch.int8)
        group = q.shape[1]
    else:
        group = scheme.group
    zeros = None
    if not scheme.symmetric:
        zeros = _read_zero_points(source.get_slice(key + "_zero_point"), scheme, rows, cols, packed.get_shape()[0])
    return QuantizedWeight(scheme.kind, group, q, s.contiguous(), zeros)


def _read_zero_points(sl, scheme: WeightScheme, rows, cols, out: int) -> torch.Tensor:
    groups = tuple(sl.get_shape())[1]
    g0, g1 = (0, groups) if cols is None else (cols[0] // scheme.group, cols[1] // scheme.group)
    ranges = rows if rows is not None else [(0, out)]
    parts = []
    for a, b in ranges:
        if sl.get_dtype() == "I8":
            z = sl[a:b, g0:g1].to(torch.int16) + 8
        else:
            # Packed along the rows: word w holds rows 8w..8w+7, row 8w+i at bits 4i.
            per_word = 32 // scheme.bits
            w0, w1 = a // per_word, -(-b // per_word)
            words = sl[w0:w1, g0:g1].to(torch.int64)
            nibbles = torch.stack([(words >> (scheme.bits * i)) & ((1 << scheme.bits) - 1) for i in range(per_word)], dim=1)
            z = nibbles.reshape(-1, g1 - g0)[a - w0 * per_word : b - w0 * per_word]
        parts.append(z)
    return torch.cat(parts, dim=0).to(torch.uint8).contiguous()


def to_packed(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """A whole quantized matrix -> its stored tensors, by suffix (`_packed`, ...)."""
    check_host()
    out, cols = qw.shape
    q = qw.qweight.contiguous()
    if qw.scheme == "int8":
        q = q.view(torch.uint8) ^ 0x80
    tensors = {
        "_packed": q.contiguous().view(torch.int32),
        "_scale": qw.scales.contiguous() if qw.scheme == "int4" else qw.scales.reshape(out, 1).contiguous(),
        "_shape": torch.tensor([out, cols], dtype=torch.int64),
    }
    if qw.zeros is not None:
        z = qw.zeros.to(torch.int64)  # [out, G], 0..15
        pad = -out % 8
        if pad:
            z = torch.cat([z, torch.zeros(pad, z.shape[1], dtype=torch.int64)])
        z = z.view(-1, 8, z.shape[1])
        words = sum(z[:, i] << (4 * i) for i in range(8))
        # Two's complement: the top nibble's bit 31 makes the word negative as an int32.
        words = torch.where(words >= 2**31, words - 2**32, words)
        tensors["_zero_point"] = words.to(torch.int32).contiguous()
    return tensors


def quantization_config(scheme: WeightScheme, ignore: list[str]) -> dict:
    """config.json's `quantization_config` for linear weights in `scheme`, but those in `ignore`."""
    weights = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group if scheme.bits == 4 else None,
        "strategy": "group" if scheme.bits == 4 else "channel",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }

"""What names and shapes a checkpoint's quantized weights are stored under: the compressed-tensors
companions of a packed weight (pocketllm/loader/compressed_tensors.py reads them) and an fp8
weight's block scales (pocketllm/loader/fp8.py). Torch-free: the launcher checks a checkpoint
against them before it starts a rank."""

from __future__ import annotations

import math
import sys

from pocketllm.errors import CheckpointError
from pocketllm.quantization import WeightScheme

# An fp8 weight's block scales: `X.weight` + this.
SCALE_SUFFIX = "_scale_inv"


def check_host() -> None:
    if sys.byteorder != "little":
        raise CheckpointError("compressed-tensors packed weights are read as little-endian int32 words; this host is big-endian")


def expected_companions(key: str, shape: tuple[int, int], scheme: WeightScheme) -> dict[str, tuple[tuple[int, ...], set[str]]]:
    """name -> (shape, allowed safetensors dtypes) for a packed weight of full `shape`.
    The zero point may be packed (int32) or not (int8); the caller checks either form."""
    out, cols = shape
    groups = 1 if scheme.bits == 8 else cols // scheme.group
    floats = {"BF16", "F16", "F32"}
    found = {
        key + "_packed": ((out, cols * scheme.bits // 32), {"I32"}),
        key + "_scale": ((out, groups), floats),
        key + "_shape": ((2,), {"I64", "I32"}),
    }
    if not scheme.symmetric:
        found[key + "_zero_point"] = ((math.ceil(out * scheme.bits / 32), groups), {"I32"})
    return found

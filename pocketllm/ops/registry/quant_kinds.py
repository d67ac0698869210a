"""The kinds for int8 and int4 weight-only quantized projections (a QuantizedWeight,
pocketllm.ops.quant.layout): one row (a decode step) and many rows (a prefill) for each family; a
few-row pass runs the many-row kernel. Every kind has the reference product as its candidate."""

from __future__ import annotations

import torch

from pocketllm.ops.quant.layout import QuantizedWeight, quant_linear_reference
from pocketllm.ops.registry.kinds import MANY, ONE, Candidate, Kind, register

# The reference dequantizes to fp32: it runs this many output rows at a time, so its temporary
# stays small beside the weight (a 27B head is 5 GB in fp32).
REFERENCE_ROWS = 1024
REFERENCE = "ref"


def reference_rows(x: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> None:
    """x [m, in] -> out [m, out]: the reference product a block of output rows at a time."""
    for r0 in range(0, qw.shape[0], REFERENCE_ROWS):
        r1 = min(r0 + REFERENCE_ROWS, qw.shape[0])
        quant_linear_reference(x, qw.rows(r0, r1), out[:, r0:r1])


def reference_one(x: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> None:
    """x [in] -> out [out]."""
    reference_rows(x[None], qw, out[None])


KINDS = {}
for _family in ("int8", "int4"):
    _tag = _family.upper()
    _ref = "the reference product (dequantized, fp32 GEMM)"
    KINDS[(_family, ONE)] = register(Kind(ONE, _family, ONE, f"POCKETLLM_{_tag}_GEMV", (Candidate(REFERENCE, reference_one, _ref),), default=REFERENCE))
    KINDS[(_family, MANY)] = register(
        Kind(MANY, _family, MANY, f"POCKETLLM_{_tag}_GEMM", (Candidate(REFERENCE, reference_rows, _ref),), default=REFERENCE, probe="widest")
    )

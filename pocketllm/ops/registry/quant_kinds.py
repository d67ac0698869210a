"""The kinds for int8 and int4 weight-only quantized projections (a QuantizedWeight,
pocketllm.ops.quant.layout): one row (a decode step), a few rows (a decode step of several
sequences) and many rows (a prefill) for each family. Every kind has the reference product as a
candidate (its default, never timed: it dequantizes the weight to fp32 on every call) beside the
candidates of pocketllm.ops.quant.candidates: the compiled GEMVs, dequantized blocks into torch's
GEMM, and torch's own int8/int4 pack ops.

torch's int4 layout is a second copy of the weight (Candidate.copies): it is timed on the probe
weights, its copies dropped after, and a measured choice of it gives way to the fastest kernel of
the loaded layout (Choice.runs) unless forced, so a bound projection never holds both."""

from __future__ import annotations

import torch

from pocketllm.ops.quant import candidates as qc
from pocketllm.ops.quant import native
from pocketllm.ops.quant.layout import QuantizedWeight, quant_linear_reference
from pocketllm.ops.registry.kinds import FEW, MANY, ONE, Candidate, Kind, register

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


# The compiled GEMVs' per-row order: one tile function runs one row and a few, each row summed
# alike (tests/test_quant_kernels.py holds them bit for bit), so a batch-invariant run may choose
# them for a decode step of several sequences. The int8-x tiles round x first: an order of their own.
_ORDER = "ops/quant gemv tiles"
_ORDER_INT8_X = "ops/quant int8-x tiles"


def _candidate(c: qc.QuantCandidate) -> Candidate:
    compiled = bool(c.sources) and c.name.startswith("c")
    order = (_ORDER_INT8_X if c.rounds_x else _ORDER) if compiled and c.rows in (ONE, FEW) else ""
    # The compiled GEMV takes x [in] or [m, in] (ops/quant/native.gemv).
    return Candidate(
        c.name, c.run, c.what, c.unavailable, c.prepare, c.layout, c.sources, copies=c.name == "int4pack", row_order=order, takes_rows=compiled,
    )


def _of_family(family: str, candidates) -> tuple[Candidate, ...]:
    # Each family's kinds hold the candidates that can run it (torch's pack ops are per scheme,
    # the int8-x tiles int4's).
    return tuple(_candidate(c) for c in candidates if (not c.name.endswith("pack") or c.name.startswith(family)) and not (c.rounds_x and family != "int4"))


_REF = "the reference product (dequantized, fp32 GEMM; never timed)"
KINDS: dict[tuple[str, str], Kind] = {}
for _family in ("int8", "int4"):
    _isa = (lambda scheme: lambda: native.isa(scheme))(_family)
    _ref_one = Candidate(REFERENCE, reference_one, _REF, measured=False)
    _ref_rows = Candidate(REFERENCE, reference_rows, _REF, measured=False)
    # c-int8x is in no prefer list: where it streams no faster than a tile that takes x as it is
    # (a wash), that tile is chosen.
    KINDS[(_family, ONE)] = register(Kind(
        ONE, _family, ONE, (_ref_one, *_of_family(_family, qc.ONE_ROW)),
        default=REFERENCE, prefer=("c-prefetch", "c-prefetch-far", "c-ahead", "c"), streams=True, isa=_isa,
    ))
    KINDS[(_family, FEW)] = register(Kind(
        FEW, _family, FEW, (_ref_rows, *_of_family(_family, qc.FEW_ROW)),
        default=REFERENCE, prefer=("c-prefetch", "c-prefetch-far", "c-ahead", "c"), isa=_isa,
    ))
    KINDS[(_family, MANY)] = register(Kind(
        MANY, _family, MANY, (_ref_rows, *_of_family(_family, qc.MANY_ROW)),
        # The bf16 blocks round each weight once more than the fp32 ones: a wash keeps fp32's.
        default=REFERENCE, prefer=("dequant-f32",), probe="widest", isa=_isa,
    ))

"""The kinds for int8 and int4 weight-only quantized projections (a QuantizedWeight,
pocketllm.ops.quant.layout): one row (a decode step), a few rows (a decode step of several
sequences) and many rows (a prefill) for each family. Every kind has the plain torch form
(ops.quant.torch_ops.quant_linear_torch) as a candidate (its default, never timed: it dequantizes
the weight to fp32 on every call) beside the candidates of pocketllm.ops.quant.candidates: the
compiled GEMVs, dequantized blocks into torch's GEMM, and torch's own int8/int4 pack ops.

torch's int4 layout is a second copy of the weight (Candidate.copies): it is timed on the probe
weights, its copies dropped after, and a measured choice of it gives way to the fastest kernel of
the loaded layout (Choice.runs) unless forced, so a bound projection never holds both."""

from __future__ import annotations

from pocketllm.ops.quant import candidates as qc
from pocketllm.ops.quant import native
from pocketllm.ops.quant.torch_ops import quant_linear_torch, quant_linear_torch_one
from pocketllm.ops.registry.kinds import FEW, MANY, ONE, Candidate, Kind, register

# Every kind's default: the plain torch form.
TORCH = "torch"

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
    # Each family's kinds hold the candidates that can run it (torch's pack ops are per scheme).
    return tuple(_candidate(c) for c in candidates if not c.name.endswith("pack") or c.name.startswith(family))


_TORCH = "the weight dequantized to fp32 by torch a block of rows at a time, torch's fp32 GEMM; never timed"
KINDS: dict[tuple[str, str], Kind] = {}
for _family in ("int8", "int4"):
    _isa = (lambda scheme: lambda: native.isa(scheme))(_family)
    _torch_one = Candidate(TORCH, quant_linear_torch_one, _TORCH, measured=False)
    _torch_rows = Candidate(TORCH, quant_linear_torch, _TORCH, measured=False)
    # c-int8x (and c-int8x-l2) is in no prefer list: where it streams no faster than a tile that takes x as it is
    # (a wash), that tile is chosen.
    KINDS[(_family, ONE)] = register(Kind(
        ONE, _family, ONE, (_torch_one, *_of_family(_family, qc.ONE_ROW)),
        default=TORCH, prefer=("c-prefetch", "c-prefetch-far", "c-ahead", "c", "c-l2"), streams=True, isa=_isa,
    ))
    KINDS[(_family, FEW)] = register(Kind(
        FEW, _family, FEW, (_torch_rows, *_of_family(_family, qc.FEW_ROW)),
        default=TORCH, prefer=("c-prefetch", "c-prefetch-far", "c-ahead", "c", "c-l2"), isa=_isa,
    ))
    KINDS[(_family, MANY)] = register(Kind(
        MANY, _family, MANY, (_torch_rows, *_of_family(_family, qc.MANY_ROW)),
        # The bf16 blocks round each weight once more than the fp32 ones: a wash keeps fp32's.
        default=TORCH, prefer=("dequant-f32",), probe="widest", isa=_isa,
    ))

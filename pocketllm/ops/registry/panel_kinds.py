"""The kinds for bf16 weights held in panels (ops.gemv.panels): one row, a few rows and many rows.
Every candidate sums an output as one fp32 chain over its inputs in order, so all share one row
order: a decode row gets the same bits alone, beside other sequences' rows, and as a prompt row.
The torch form (the weight unpacked on every call) is there for a run that forces it; it is
never timed."""

from __future__ import annotations

from pathlib import Path

from pocketllm.ops.gemv import panels
from pocketllm.ops.registry.kinds import FEW, MANY, ONE, Candidate, Kind, register

# The compiled source, and the module that holds the weights for it (their memory's pages): a
# choice measured on another placement says nothing about this one.
_C = (panels.SOURCE, Path(panels.__file__))
_ORDER = "panel_bf16.c"
# Inputs a one-row call reads of one panel before the next stream's: 4 KiB of it.
STREAM_BLOCK = 32
# Inputs a few- or many-row call runs a panel's block over at a time: 16 KiB of the panel, in L1
# beside x's rows (docs/batching.md, panels).
BLOCK_INPUTS = 128


def _unavailable(fmt: str, device) -> str:
    return panels.unavailable(device)


def _isa() -> str:
    why = panels.unavailable()
    return why or "avx2"


_TORCH = Candidate("torch", panels.unpacked, "the weight unpacked to rows on every call, torch's fp32 GEMM; never timed", measured=False)


def _streams(name: str, streams: int, block: int, what: str) -> Candidate:
    return Candidate(name, panels.one_row(streams, block), what, _unavailable, sources=_C, row_order=_ORDER, takes_rows=True)


def _tile(name: str, mr: int, what: str) -> Candidate:
    return Candidate(name, panels.rows(mr, BLOCK_INPUTS), what, _unavailable, sources=_C, row_order=_ORDER)


_FOUR, _SIX = "four x rows by 16 weight rows at a time", "six x rows by 16 weight rows at a time"

ONE_ROW = register(Kind(
    ONE, "panels", ONE,
    (
        _streams("c", 2, STREAM_BLOCK, "pocketllm's compiled one-row product on panels (ops/gemv/panel_bf16.c), each thread's panels read as two streams"),
        _streams("c-1", 1, STREAM_BLOCK, "the same, one stream a thread"),
        _streams("c-4", 4, STREAM_BLOCK // 2, "the same, four streams a thread"),
        _TORCH,
    ),
    default="c", prefer=("c", "c-4", "c-1"), streams=True, isa=_isa,
))

FEW_ROW = register(Kind(
    FEW, "panels", FEW, (_tile("c", 4, f"the compiled product on panels, {_FOUR}"), _tile("c-6", 6, f"the same, {_SIX}"), _TORCH),
    default="c", prefer=("c", "c-6"), isa=_isa,
))

MANY_ROW = register(Kind(
    MANY, "panels", MANY, (_tile("c", 6, f"the compiled product on panels, {_SIX}"), _tile("c-4", 4, f"the same, {_FOUR}"), _TORCH),
    default="c", prefer=("c", "c-4"), probe="widest", isa=_isa,
))

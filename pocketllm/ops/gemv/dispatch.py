"""The kernel each weight shape runs, once chosen: looked up per call by shape and dtype (and, for
a few rows, by the row count chosen for)."""

from __future__ import annotations

import bisect

import torch

from pocketllm.ops.gemv.choice import GemvChoice
from pocketllm.ops.gemv.kernels import CANDIDATES, DEFAULT, FEW_ROW_CANDIDATES

_default = CANDIDATES[DEFAULT].run
# (out, in, dtype) -> kernel; a shape never chosen runs the default.
_table: dict[tuple[int, int, torch.dtype], object] = {}
# (rows, out, in, dtype) -> few-row kernel, for the row counts chosen for (sorted in _few_rows).
_few: dict[tuple[int, int, int, torch.dtype], object] = {}
_few_rows: list[int] = []
_installed: GemvChoice | None = None


def install(choice: GemvChoice, dtype: torch.dtype) -> None:
    """Make `choice` the kernels for weights of `dtype` (at its row count) from now on, in this
    process."""
    global _installed
    if choice.rows > 1:
        for (o, i), name in choice.by_shape.items():
            _few[(choice.rows, o, i, dtype)] = FEW_ROW_CANDIDATES[name].run
        if choice.rows not in _few_rows:
            bisect.insort(_few_rows, choice.rows)
        return
    for (o, i), name in choice.by_shape.items():
        _table[(o, i, dtype)] = CANDIDATES[name].run
    _installed = choice


def installed() -> GemvChoice | None:
    return _installed


def gemv_row(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out [out] = w [out, in] @ x [in], by the kernel chosen for w's shape."""
    _table.get((w.shape[0], w.shape[1], w.dtype), _default)(x, w, out)


def few_rows_kernel(rows: int, w: torch.Tensor):
    """The kernel chosen for `rows` rows of w's shape: the choice made for it at the smallest row
    count at or above `rows`; None when no choice covers it (torch's GEMM then runs)."""
    for chosen in _few_rows[bisect.bisect_left(_few_rows, rows) :]:
        kernel = _few.get((chosen, w.shape[0], w.shape[1], w.dtype))
        if kernel is not None:
            return kernel
    return None

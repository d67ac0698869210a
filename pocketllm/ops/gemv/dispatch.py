"""The kernel each weight shape runs, once chosen: looked up per call by shape and dtype."""

from __future__ import annotations

import torch

from pocketllm.ops.gemv.choice import GemvChoice
from pocketllm.ops.gemv.kernels import CANDIDATES, DEFAULT

_default = CANDIDATES[DEFAULT].run
# (out, in, dtype) -> kernel; a shape never chosen runs the default.
_table: dict[tuple[int, int, torch.dtype], object] = {}
_installed: GemvChoice | None = None


def install(choice: GemvChoice, dtype: torch.dtype) -> None:
    """Make `choice` the kernels for weights of `dtype` from now on, in this process."""
    global _installed
    for (o, i), name in choice.by_shape.items():
        _table[(o, i, dtype)] = CANDIDATES[name].run
    _installed = choice


def installed() -> GemvChoice | None:
    return _installed


def gemv_row(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out [out] = w [out, in] @ x [in], by the kernel chosen for w's shape."""
    _table.get((w.shape[0], w.shape[1], w.dtype), _default)(x, w, out)

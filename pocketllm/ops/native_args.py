"""Why a tensor cannot go to a compiled kernel: the wrappers in ops/gemv/kernels.py and
ops/fused/kernels.py pass raw pointers, so a wrong dtype, size or stride would read or write out
of bounds instead of failing. Each wrapper tests its arguments in one expression of attribute reads
(the hot path); only when that fails does `refuse` find the argument at fault and raise one
ValueError naming it."""

from __future__ import annotations

import torch


def refuse(kernel: str, specs) -> None:
    """Raise a ValueError naming the first argument of `kernel` that breaks its spec. specs are
    (name, value, dtype, numel or None, contiguous: bool, ndim or None); a None value is an
    absent optional argument."""
    for name, t, dtype, numel, contiguous, ndim in specs:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{kernel}: {name} must be a tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{kernel}: {name} must be on the CPU, got {t.device}")
        if t.dtype != dtype:
            raise ValueError(f"{kernel}: {name} must be {str(dtype).removeprefix('torch.')}, got {str(t.dtype).removeprefix('torch.')}")
        if ndim is not None and t.dim() != ndim:
            raise ValueError(f"{kernel}: {name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
        if numel is not None and t.numel() != numel:
            raise ValueError(f"{kernel}: {name} has shape {tuple(t.shape)} ({t.numel()} elements) where {numel} are needed")
        if contiguous and not t.is_contiguous():
            raise ValueError(f"{kernel}: {name} must be contiguous, got strides {t.stride()}")
    raise ValueError(f"{kernel}: arguments do not fit together")

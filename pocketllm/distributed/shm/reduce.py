"""The reduce at the heart of the shared-memory all-reduce, twice with one signature: the C
helper's (what the collective runs) and a plain torch reference that says what it must compute.
Both sum `parts` element-wise in fp32, in rank order, and round once to `out`'s dtype."""

from __future__ import annotations

import ctypes

import torch

from pocketllm.distributed.shm import build

# The helper's dtype codes (PL_F32, PL_BF16, PL_F16 in allreduce.c).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lib = None


def library():
    """The helper, built on first use."""
    global _lib
    if _lib is None:
        _lib = build.load(build.build())
    return _lib


def reduce_sum_(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """out = sum(parts), by the C helper. Every tensor contiguous, on CPU, of out's dtype and size."""
    for p in parts:
        if p.dtype != out.dtype or p.numel() != out.numel() or not p.is_contiguous():
            raise ValueError("every part must be a contiguous tensor of out's dtype and size")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    ptrs = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in parts))
    library().pl_reduce(DTYPE_CODES[out.dtype], out.data_ptr(), ptrs, len(parts), 0, out.numel())
    return out


def reduce_sum_reference_(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """out = sum(parts) in plain torch: fp32 accumulation in rank order, one rounding (torch's
    fp32-to-bf16/fp16 conversion rounds to nearest, ties to even)."""
    acc = parts[0].to(torch.float32, copy=True)
    for p in parts[1:]:
        acc += p.to(torch.float32)
    return out.copy_(acc.view(out.shape))

"""The torch ops a callable issues, as the dispatcher sees them: what a test bounds when it bounds
the kernels a pass launches. A custom op (one fused kernel, pocketllm.ops.device) counts once,
a torch form's every aten op counts. Views and allocations launch no kernel and are told apart; an
op marked as a view that copied counts as a kernel, under its name and " (copy)"."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate without writing: no kernel runs.
_ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}


@dataclass
class OpCount:
    ops: Counter = field(default_factory=Counter)  # every op by its name, e.g. "aten::add.Tensor"
    no_kernel: set = field(default_factory=set)  # names of those that launch nothing (views, allocations)

    @property
    def kernels(self) -> Counter:
        """The ops that run a kernel, by name."""
        return Counter({name: n for name, n in self.ops.items() if name not in self.no_kernel})

    def total_kernels(self) -> int:
        return sum(self.kernels.values())


def copies(func, args: tuple, out) -> bool:
    """Whether an op the dispatcher calls a view made a tensor of its own: under inference_mode
    reshape, contiguous and to() reach a dispatch mode whole, marked as views (their schemas may
    alias), whether they returned a view or copied."""
    if not func.is_view or not isinstance(out, torch.Tensor):
        return False
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return out.untyped_storage().data_ptr() not in inputs


class _Counting(TorchDispatchMode):
    def __init__(self, count: OpCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args: tuple = (), kwargs: dict | None = None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if copies(func, args, out):
            name += " (copy)"
        elif func.is_view or name.split(".")[0] in _ALLOCATIONS:
            self.count.no_kernel.add(name)
        self.count.ops[name] += 1
        return out


def count_ops(fn, *args, **kwargs):
    """(fn(*args, **kwargs), OpCount of the ops it issued). An op's own inner ops are not seen: the
    mode is off while an op runs, so a custom op is one op whatever its implementation does."""
    count = OpCount()
    with _Counting(count):
        result = fn(*args, **kwargs)
    return result, count

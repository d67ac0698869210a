"""The row-parallel projection followed by its TP all-reduce, overlapped slice by slice.

Slice i's all-reduce is started asynchronously right after slice i's GEMM, so it runs under slice
i+1's GEMM: on CUDA/NPU on the backend's communication stream, on CPU on gloo's own thread. Every
GEMM writes straight into its slice of the one output buffer and every all-reduce works on that
slice in place, so slicing adds no copies.
"""

from __future__ import annotations

import torch

from pocketllm.distributed import waiting
from pocketllm.distributed.state import all_reduce_, all_reduce_async_, tp
from pocketllm.profiling.scopes import scope


def slice_bounds(rows: int, slices: int) -> list[tuple[int, int]]:
    """`slices` contiguous row ranges covering `rows`; earlier ones take the remainder, so the last
    may be shorter."""
    base, extra = divmod(rows, slices)
    bounds, start = [], 0
    for i in range(slices):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def is_serial(rows: int, slices: int) -> bool:
    return slices <= 1 or tp().world == 1 or rows < slices


def projection_all_reduce_overlapped(x: torch.Tensor, project, slices: int, site: str, parts=None) -> torch.Tensor:
    """x [rows, in_local] through `project` (a projection's bound kernels: project(x, out) writes
    x @ weight^T into out [rows, out_features]), summed over ranks; the same result as the serial
    GEMM-then-all-reduce for every slice count.

    parts (a pass's layers.context.Part list; None: one part of all rows, sliced by `slices`):
    the row ranges projected in calls of their own, each by the call its part takes (Part.kernel:
    `project.alone`, `project.many` or by row count), a part of a prompt segment cut into its own
    `slices` when it has them. The all-reduces then go
    by `slices` over all the rows, each started once the calls covering its range are done: the
    sum of an element does not depend on which all-reduce carries it (the shm all-reduce adds
    ranks in rank order, and two ranks' sum is the same either way)."""
    rows = x.shape[0]
    if rows == 1 and parts is not None and len(parts) == 1:
        # A decode step of one row: one call and one all-reduce, what the general path below
        # comes to for one row, without building its lists (16 of these calls a step).
        with scope("projections", site):
            out = parts[0].kernel(project)(x)
        all_reduce_(out, site)
        return out
    out = torch.empty(rows, project.out_features, dtype=x.dtype, device=x.device)
    if parts is None:
        calls = [(0, rows, project)] if is_serial(rows, slices) else [(a, b, project) for a, b in slice_bounds(rows, slices)]
    else:
        calls = []
        for p in parts:
            run = p.kernel(project)
            if p.alone or is_serial(p.end - p.start, p.slices):
                calls.append((p.start, p.end, run))
            else:
                calls += [(p.start + a, p.start + b, run) for a, b in slice_bounds(p.end - p.start, p.slices)]
    # Where each all-reduce ends: the policy's slice ends, each moved on to the end of a call.
    ends = [e for _, e, _ in calls]
    groups = [] if is_serial(rows, slices) else sorted({next(e for e in ends if e >= b) for _, b in slice_bounds(rows, slices)})
    if len(groups) <= 1:
        with scope("projections", site):
            for a, b, run in calls:
                run(x[a:b], out[a:b])
        all_reduce_(out, site)
        return out
    works, begun = [], 0
    for a, b, run in calls:
        with scope("projections", site):
            run(x[a:b], out[a:b])
        if b in groups:
            works.append(all_reduce_async_(out[begun:b], site))
            begun = b
    # The collective time the overlap left exposed (near zero under a phase profile, which
    # already waited for each slice inside its tp_all_reduce scope).
    with scope("tp_wait", site):
        for work in works:
            waiting.wait(work)
    return out

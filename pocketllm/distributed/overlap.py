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


def projection_all_reduce_overlapped(x: torch.Tensor, project, slices: int, site: str) -> torch.Tensor:
    """x [rows, in_local] through `project` (a projection's bound kernels: project(x, out) writes
    x @ weight^T into out [rows, out_features]), summed over ranks; the same result as the serial
    GEMM-then-all-reduce for every slice count."""
    rows = x.shape[0]
    out = torch.empty(rows, project.out_features, dtype=x.dtype, device=x.device)
    if is_serial(rows, slices):
        with scope("projections", site):
            project(x, out)
        all_reduce_(out, site)
        return out
    works = []
    for start, end in slice_bounds(rows, slices):
        with scope("projections", site):
            project(x[start:end], out[start:end])
        works.append(all_reduce_async_(out[start:end], site))
    # The collective time the overlap left exposed (near zero under a phase profile, which
    # already waited for each slice inside its tp_all_reduce scope).
    with scope("tp_wait", site):
        for work in works:
            waiting.wait(work)
    return out

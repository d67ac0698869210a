"""Host memory for the weights: zeroed CPU tensors placed on transparent huge pages.

A decode step streams every weight once. On 4 KiB pages that stream walks a new page table entry
every 4 KiB and evicts the rest of the step's TLB entries; on 2 MiB pages it does neither, which
measured a little faster for a whole-memory sum and a decode step (docs/measuring.md, figures
behind the code's choices). torch's allocator gives
4 KiB pages unless a region is advised otherwise, so large weights get their own anonymous
mapping, advised with MADV_HUGEPAGE. The kernel still decides: with THP off the mapping is plain
pages, exactly what torch.zeros would have given.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 * 2**20
# Below one huge page the advice cannot apply; such tensors (norm scales, biases) come from torch.
MIN_BYTES = HUGE_PAGE


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device), on huge pages when on CPU and large."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # One huge page of slack so the tensor can start on a 2 MiB boundary; the slack is never
    # touched, so it costs address space, not memory. Anonymous pages read as zero until written.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer holds a reference to the mapping: it is unmapped when the last view dies.
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    # Only the tensor's whole huge pages are advised: a huge page over its tail would also cover
    # slack it never uses, up to 2 MiB of memory per weight.
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
    except OSError:
        # A kernel built without THP refuses the advice; plain pages still work.
        pass
    return raw[start : start + nbytes].view(dtype).view(shape)

"""Host memory: zeroed CPU tensors for the weights placed on transparent huge pages, glibc's heap
kept for the activations of large passes, and torch's per-shape GEMM caches bounded.

A decode step streams every weight once. On 4 KiB pages that stream walks a new page table entry
every 4 KiB and evicts the rest of the step's TLB entries; on 2 MiB pages it does neither, which
measured a little faster for a whole-memory sum and a decode step (docs/measuring.md, figures
behind the code's choices). torch's allocator gives
4 KiB pages unless a region is advised otherwise, so large weights get their own anonymous
mapping, advised with MADV_HUGEPAGE. The kernel still decides: with THP off the mapping is plain
pages, exactly what torch.zeros would have given.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Sequence

from pocketllm.errors import UsageError
from pocketllm.switches import env_switch

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
    return mapped_bytes(nbytes).view(dtype).view(shape)


def mapped_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8) on an anonymous mapping of their own, starting on a 2 MiB
    boundary, their whole huge pages advised; unmapped when the last view dies."""
    # One huge page of slack so the tensor can start on a 2 MiB boundary; the slack is never
    # touched, so it costs address space, not memory. Anonymous pages read as zero until written.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer holds a reference to the mapping: it is unmapped when the last view dies.
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    # Only the tensor's whole huge pages are advised: a huge page over its tail would also cover
    # slack it never uses, up to 2 MiB of memory per weight.
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        except OSError:
            # A kernel built without THP refuses the advice; plain pages still work.
            pass
    return raw[start : start + nbytes]


class Arena:
    """Tensors carved one after another out of `nbytes` on a mapping of their own (mapped_bytes),
    each 64-byte aligned; the mapping goes when the last of them does. For long-lived copies that
    must not sit in glibc's heap: there, among a pass's short-lived buffers (kept by
    keep_freed_blocks), they fragment it, and the heap never shrinks."""

    ALIGN = 64

    def __init__(self, nbytes: int):
        self.raw = mapped_bytes(max(nbytes, 1))
        self.used = 0

    @staticmethod
    def room(tensors: Sequence[torch.Tensor]) -> int:
        """The bytes an arena needs to hold copies of `tensors`, alignment included."""
        return sum(t.numel() * t.element_size() + Arena.ALIGN for t in tensors)

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of t's shape and dtype, from the arena."""
        start = -(-self.used // self.ALIGN) * self.ALIGN
        end = start + t.numel() * t.element_size()
        if end > len(self.raw):
            raise ValueError(f"the arena holds {len(self.raw)} bytes, and {end} are asked")
        self.used = end
        return self.raw[start:end].view(t.dtype).view(t.shape)


ENV_KEEP_FREED = "POCKETLLM_KEEP_FREED"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Blocks up to this size come from the heap and stay there when freed.
KEEP_UP_TO = 2**30


def keep_freed_blocks(env=os.environ) -> bool:
    """Make glibc serve allocations up to KEEP_UP_TO from its heap and keep freed memory there.
    By default it maps every block over 32 MiB afresh and unmaps it when freed, so a pass whose
    activations exceed that (a prompt of thousands of rows, or several prompts packed into one
    pass) pays a page fault for every 4 KiB of every such block, every pass; kept, the next pass
    reuses the same memory. The peak is what the largest pass needs either way; the heap just
    does not shrink after it. Call after the weights are loaded (they have their own mappings
    anyway). POCKETLLM_KEEP_FREED=0 leaves glibc's defaults. Returns whether it applied."""
    if not env_switch(env, ENV_KEEP_FREED, default=True):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc (musl, macOS): its allocator behaves its own way
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_UP_TO)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_UP_TO))


# torch's bf16 GEMM on a CPU (oneDNN, through ideep) keeps what it builds for each new shape in two
# caches of its own: ideep's descriptors (LRU_CACHE_CAPACITY entries) and oneDNN's primitives with
# their generated code (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 each by default, an entry of each
# ~1-2 MB together. A prefill's last chunk has as many rows as the prompt leaves (any count up to
# the chunk), so a server's GEMM shapes never repeat for long, and the defaults let it grow by
# more than a GB before they evict anything. A pass uses a handful of shapes (one per projection
# weight's shape, at its row count): a bound of a few dozen passes keeps every shape a steady
# workload repeats (the full chunk, each decode batch size where a GEMM runs it), and a shape met
# again after it was evicted is built again, in about a millisecond (docs/serving.md).
GEMM_CACHE_ENTRIES = 128
GEMM_CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_gemm_caches(env=os.environ) -> dict[str, str]:
    """Bound each of torch's per-shape GEMM caches at GEMM_CACHE_ENTRIES entries, unless the user
    has set its variable. Both are read when first used (oneDNN's once per process, ideep's once
    per thread), so this is called before an engine runs its first GEMM. Returns the settings in
    force. ideep's cache with no entries crashes the process at the first GEMM: a count below 1
    is refused here, naming the variable."""
    for name in GEMM_CACHES:
        if not env.get(name):
            env[name] = str(GEMM_CACHE_ENTRIES)
    given = env["LRU_CACHE_CAPACITY"].strip()
    if given.lstrip("+-").isdigit() and int(given) < 1:
        raise UsageError(f"LRU_CACHE_CAPACITY={given}: torch's GEMM cache needs at least 1 entry (with none it crashes)")
    return {name: env[name] for name in GEMM_CACHES}

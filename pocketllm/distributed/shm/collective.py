"""The shared-memory all-reduce as the engine calls it: an in-place sum of a CPU tensor over the
ranks that mapped one segment, done by the C helper on the calling rank's own core."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pocketllm.distributed.shm import segment as shm_segment
from pocketllm.distributed.shm.reduce import DTYPE_CODES

# Bytes per rank per chunk: a larger payload goes through the segment in chunks of this size,
# small enough that a chunk's copies stay in a core's L2 (docs/collectives.md). The segment is
# 2 x (world + 1) chunks, 1.5 MiB at TP=2.
CHUNK_BYTES = 256 << 10
# Up to this many bytes per chunk, each rank reduces every element itself after one flag wait;
# above it, each reduces its 1/world share and copies the result out after a second wait: past a
# few KiB, summing a share instead of the whole saves more than the second wait costs (where they
# cross is in docs/collectives.md).
ONE_STEP_BYTES = 8 << 10
# How a rank waits for its peers. With a core of its own, it spins for up to SPIN_NS (most waits
# end there) and then sleeps between looks: yielding instead lets any other runnable process take
# the core for a whole time slice, which on a host shared with other work made TP=2 prefill slower
# than gloo (docs/collectives.md). Ranks that share a core never spin (the peer a rank waits
# for may be the one its spinning keeps off the core) and yield for up to SHARED_YIELD_NS, which
# hands the core to that peer, before they sleep too. Spinning can also slow the GEMMs of a rank
# on another vCPU (docs/collectives.md), which is why the spin stays short.
SPIN_NS = 200_000
SHARED_YIELD_NS = 20_000_000
# The helper's return codes (allreduce.c).
_TIMEOUT, _PEER_GONE = 1, 2


class ShmCollectiveError(dist.DistError):
    """A shared-memory all-reduce that a peer never joined (collective_kind "timeout") or whose
    peer died (collective_kind "peer"); the launcher words it as it words gloo's."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.collective_kind = kind


class ShmAllReduce:
    def __init__(self, lib, seg: shm_segment.Segment, rank: int, world: int, timeout_s: float, shares_cores: bool = False):
        self.lib, self.seg, self.rank, self.world, self.timeout_s = lib, seg, rank, world, timeout_s
        # The helper spins until spin_ns, yields until yield_ns, then sleeps.
        self.spin_ns, self.yield_ns = (0, SHARED_YIELD_NS) if shares_cores else (SPIN_NS, 0)

    @staticmethod
    def segment_bytes(lib, world: int) -> int:
        return lib.pl_segment_bytes(world, CHUNK_BYTES)

    def attach(self, pid: int) -> None:
        self.lib.pl_attach(self.seg.base, self.world, self.rank, CHUNK_BYTES, pid)

    @staticmethod
    def handles(t: torch.Tensor) -> bool:
        """Whether this collective sums `t` (every rank asks about the same tensor shape and dtype,
        so all take the same path)."""
        return t.device.type == "cpu" and t.dtype in DTYPE_CODES

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place; returns when every rank's sum is in."""
        if not t.is_contiguous():
            flat = t.contiguous()
            self.all_reduce_(flat)
            t.copy_(flat)
            return
        seg, code = self.seg.base, DTYPE_CODES[t.dtype]
        rc = self.lib.pl_all_reduce(
            seg, self.world, self.rank, CHUNK_BYTES, code, t.data_ptr(), t.numel(), self.timeout_s, ONE_STEP_BYTES, self.spin_ns, self.yield_ns
        )
        if rc == _TIMEOUT:
            raise ShmCollectiveError(f"shm all-reduce timed out after {self.timeout_s:g} s: a peer rank never arrived", "timeout")
        if rc >= _PEER_GONE:
            raise ShmCollectiveError(f"shm all-reduce: rank {rc - _PEER_GONE} exited while this rank waited for it", "peer")

    def close(self) -> None:
        self.seg.close()

"""Which implementation runs the engine's TP all-reduce, chosen once per run.

- `shm`: every rank is a CPU (gloo) rank on this host: the ranks sum through one shared-memory
  segment (pocketllm.distributed.shm), a few microseconds fixed and memory bandwidth for the
  bytes, where gloo pays loopback TCP and its own threads;
- `gloo`: the process group's backend itself (gloo on CPU; on CUDA/NPU the backend, NCCL or HCCL,
  always does it).
`--collective auto|shm|gloo` (env POCKETLLM_COLLECTIVE, default auto; checked in collective_choice.py): auto takes shm where it
applies and the backend elsewhere; shm asked for where it cannot run is a one-line error. gloo
keeps every other collective (broadcasts, barriers, gathers, the rendezvous) and is the fallback
when the helper cannot be built. The choice is printed once on rank 0 and written to --json.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from pocketllm.distributed.collective_choice import check_choice
from pocketllm.errors import UsageError

# The helper keeps flag and region tables for at most this many ranks.
MAX_SHM_WORLD = 64


class _Done:
    """The work handle of a collective that finished before it was returned."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


_DONE = _Done()
_shm = None
_name: str | None = None


def name() -> str | None:
    """The all-reduce this run uses: shm, gloo, nccl or hccl; None at world size 1."""
    return _name


def start_all_reduce(t: torch.Tensor):
    """Start the in-place sum of `t` over the ranks and return its work handle.

    The shared-memory all-reduce has finished when this returns, and hands back a completed
    handle: on one host the reduce is memory copies and adds that the calling rank's core does
    itself, so there is no other engine to run it on while this rank computes, and a thread of
    its own would only take turns on the same core. Slicing the overlapped projection therefore
    hides nothing on shm; it only adds calls (docs/collectives.md)."""
    if _shm is not None and _shm.handles(t):
        _shm.all_reduce_(t)
        return _DONE
    return dist.all_reduce(t, async_op=True)


def sums_on_host(t: torch.Tensor) -> bool:
    """Whether an all-reduce of `t` would run in shared memory (microseconds, where gloo's
    gather costs a loopback round trip)."""
    return _shm is not None and _shm.handles(t)


def setup(choice: str, backend: str, rank: int, world: int, timeout_s: float, asked: str = "") -> None:
    """Choose the all-reduce on every rank of a joined group (all agree: rank 0 decides) and, for
    shm, create, map and unlink the segment. Prints the choice on rank 0, with how a choice other
    than auto was asked (`asked`: `--collective X` or `POCKETLLM_COLLECTIVE=X`)."""
    global _shm, _name
    close()
    if world == 1:
        return
    _name = backend
    check_choice(choice, backend, asked)
    if choice == "gloo" or backend != "gloo":
        _announce(rank, f"{backend} ({asked or '--collective gloo'})" if choice == "gloo" else backend)
        return
    places = [None] * world
    dist.all_gather_object(places, _place())
    offer, created = None, None
    try:
        if rank == 0:
            offer, created = _offer(places, world)
        box = [offer]
        dist.broadcast_object_list(box, src=0)
        offer = box[0]
        failure = None
        if offer[0] == "shm":
            shm, failure = _map(offer, created, rank, world, timeout_s, _share_cores([p[2] for p in places]))
        failures = [None] * world
        dist.all_gather_object(failures, failure)
    finally:
        # Every rank has mapped it (or given up): no one needs the name any more.
        if created is not None:
            from pocketllm.distributed.shm import segment

            segment.unlink(created.path)
    if offer[0] == "shm":
        bad = [(r, f) for r, f in enumerate(failures) if f]
        if not bad:
            _shm, _name = shm, "shm"
            _announce(rank, f"shm (shared memory, {world} CPU ranks on this host; gloo for the other collectives)")
            return
        if shm is not None:
            shm.close()
        reason = f"rank {bad[0][0]} could not map the segment ({bad[0][1]})"
    else:
        reason = offer[1]
    if choice == "shm":
        raise UsageError(f"{asked or '--collective shm'}: {reason}")
    _announce(rank, f"gloo (shm unavailable: {reason})")


def _place() -> tuple:
    """(host, boot, cores this rank may run on)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
    return socket.gethostname(), boot, cpus


def _share_cores(cpus: list[frozenset]) -> bool:
    """Whether two ranks may run on one core (or a rank's cores are unknown)."""
    if not all(cpus):
        return True
    seen: set = set()
    for mine in cpus:
        if seen & mine:
            return True
        seen |= mine
    return False


def _offer(places: list, world: int):
    """Rank 0's decision: ("shm", library, segment path, size) with the segment created, or
    ("gloo", why not)."""
    from pocketllm.distributed.shm import build, segment
    from pocketllm.distributed.shm.collective import ShmAllReduce

    if places[0][1] is None:
        return ("gloo", "this system does not say which boot the ranks run in (/proc/sys/kernel/random/boot_id)"), None
    if len({p[:2] for p in places}) > 1:
        return ("gloo", "the ranks are not all on one host"), None
    if world > MAX_SHM_WORLD:
        return ("gloo", f"more than {MAX_SHM_WORLD} ranks"), None
    try:
        lib_path = build.build()
        size = ShmAllReduce.segment_bytes(build.load(lib_path), world)
        created = segment.create(size)
    except build.BuildError as exc:
        return ("gloo", str(exc)), None
    except OSError as exc:
        return ("gloo", f"cannot create a segment in {segment.SHM_DIR}: {exc.strerror or exc}"), None
    return ("shm", str(lib_path), created.path, size), created


def _map(offer, created, rank: int, world: int, timeout_s: float, shares_cores: bool):
    """This rank's collective on the offered segment, or (None, why not) in one line."""
    from pocketllm.distributed.shm import build, segment
    from pocketllm.distributed.shm.collective import ShmAllReduce

    _, lib_path, path, size = offer
    try:
        seg = created if created is not None else segment.attach(path, size)
        shm = ShmAllReduce(build.load(lib_path), seg, rank, world, timeout_s, shares_cores)
        shm.attach(os.getpid())
        return shm, None
    except OSError as exc:
        return None, str(exc)


def _announce(rank: int, what: str) -> None:
    if rank == 0:
        print(f"all-reduce: {what}", file=sys.stderr, flush=True)


def close() -> None:
    """Back to no choice, the segment unmapped (before the group is left)."""
    global _shm, _name
    if _shm is not None:
        _shm.close()
    _shm, _name = None, None

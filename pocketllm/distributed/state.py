"""The one place that knows the TP rank, world size and process group. Collectives are no-ops at
world size 1, so the single-rank path never touches torch.distributed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pocketllm.distributed import collective, waiting
from pocketllm.distributed.accounting import COUNTER
from pocketllm.profiling.scopes import scope


@dataclass
class TPState:
    rank: int = 0
    world: int = 1


_TP = TPState()


def tp() -> TPState:
    return _TP


def set_tp(rank: int, world: int) -> None:
    _TP.rank, _TP.world = rank, world


def all_reduce_(t: torch.Tensor, site: str) -> None:
    """Sum `t` across ranks in place (blocking) and count it against `site`."""
    if _TP.world == 1:
        return
    COUNTER.add(site)
    with scope("tp_all_reduce", site) as timed:
        timed.wait_for_peers()
        waiting.wait(collective.start_all_reduce(t))


def all_reduce_async_(t: torch.Tensor, site: str):
    """Start an in-place sum across ranks and return its work handle; None at world size 1."""
    if _TP.world == 1:
        return None
    COUNTER.add(site)
    with scope("tp_all_reduce", site) as timed:
        timed.wait_for_peers()
        work = collective.start_all_reduce(t)
        # A phase profile waits here, so the scope holds the collective and not just its issue.
        timed.settle(work, waiting.wait)
    return work


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of `t` over ranks, on t's device (at load, not in a pass: it
    goes through the process group itself, on the device its backend needs)."""
    if _TP.world == 1:
        return t
    device = {"nccl": "cuda", "hccl": "npu"}.get(dist.get_backend())
    work = t.to(device) if device else t.clone()
    dist.all_reduce(work, op=dist.ReduceOp.MAX)
    return work.to(t.device)


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (host values, not tensors)."""
    if _TP.world == 1:
        return [obj]
    gathered: list = [None] * _TP.world
    dist.all_gather_object(gathered, obj)
    return gathered


def group_pids() -> list[int]:
    """The process id of every rank, in rank order."""
    return all_gather_objects(os.getpid())


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim, in rank order."""
    if _TP.world == 1:
        return t
    if collective.sums_on_host(t):
        n = t.shape[-1]
        full = torch.zeros(*t.shape[:-1], n * _TP.world, dtype=t.dtype, device=t.device)
        # Each rank's part at its offset of a zeroed buffer, summed: x + 0 is exactly x, so the
        # sum is the concatenation, in one shared-memory pass instead of a gloo gather (the
        # vocab-parallel head's logits every decode step).
        full[..., _TP.rank * n : (_TP.rank + 1) * n] = t
        with scope("tp_all_gather"):
            waiting.wait(collective.start_all_reduce(full))
        return full
    parts = [torch.empty_like(t) for _ in range(_TP.world)]
    with scope("tp_all_gather"):
        waiting.wait(dist.all_gather(parts, t.contiguous(), async_op=True))
    return torch.cat(parts, dim=-1)


def broadcast_(t: torch.Tensor, src: int = 0, idle: bool = False) -> None:
    """t from rank src to every rank; `idle` for a broadcast that may be long in coming
    (waiting.wait_idle)."""
    if _TP.world > 1:
        work = dist.broadcast(t, src, async_op=True)
        (waiting.wait_idle if idle else waiting.wait)(work)

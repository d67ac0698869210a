"""Whether tensor parallelism can pay on this host. Ranks on CPUs of one NUMA node share one memory
path: a decode step, which streams every weight once, reads the same bytes from it at TP=N as one
process with all their cores does at TP=1, and adds its all-reduces. Rank 0 says so once, with
what those all-reduces cost, measured on the run's own group at load."""

from __future__ import annotations

import statistics
import time

import torch

from pocketllm import topology
from pocketllm.distributed.state import all_reduce_, tp

# All-reduces a one-row step's measurement times (after one untimed): enough for a steady median.
REPS = 21


def shared_node(cpus_per_rank: list[list[int]], sysfs: str | None = None) -> int | None:
    """The one NUMA node every rank's CPUs lie on, or None when they span several (or are unknown)."""
    if any(not cpus for cpus in cpus_per_rank):
        return None
    nodes = {core.node for cpus in cpus_per_rank for core in topology.read_cores(cpus, sysfs)}
    return next(iter(nodes)) if len(nodes) == 1 else None


def all_reduce_seconds(hidden: int, dtype: torch.dtype, device: torch.device) -> float:
    """The median time of one all-reduce of a decode row's hidden state, through the run's own
    collective (every rank calls it)."""
    x = torch.zeros(1, hidden, dtype=dtype, device=device)
    times = []
    for i in range(REPS + 1):
        t0 = time.perf_counter()
        all_reduce_(x, "probe")
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def finding(cfg, dtype: torch.dtype, device: torch.device, cpus_per_rank) -> str | None:
    """The note rank 0 prints when every rank of a CPU run shares one memory path (every rank
    calls this: it gathers and measures on the group); None where the ranks have memory paths of
    their own. cpus_per_rank() gathers each rank's CPUs, asked only of a CPU run of several ranks."""
    if tp().world < 2 or device.type != "cpu":
        return None
    node = shared_node(cpus_per_rank())
    # Every rank measures, so each takes the same branch: the node is the same list everywhere.
    if node is None:
        return None
    seconds = all_reduce_seconds(cfg.hidden_size, dtype, device)
    per_step = 2 * cfg.num_layers + 1
    return (
        f"note: the {tp().world} ranks share one memory path (NUMA node {node}): a decode step reads the same weight bytes "
        f"from it as one process with all their cores does at TP=1, so it can be no faster split, and adds {per_step} "
        f"all-reduces of {cfg.hidden_size} values ({seconds * 1e6:.0f} us each here, measured now) and each rank's own "
        f"per-op work: on this host --tp-world 1 decodes at least as fast; TP pays where ranks sit on NUMA nodes of their own"
    )


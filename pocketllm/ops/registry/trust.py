"""Whether a kernel timing can be trusted: the machine was quiet while it ran, and what it says is
plausible for this machine.

Quiet: over the timing's window, the CPU time the kernel's /proc/stat counts as busy on every CPU,
less this process's own (and its peer ranks', which measure at the same time), is what other
processes took; that, or time the hypervisor stole, beyond a small share of the cores' capacity
means the timing was disturbed. Another process only ever adds time to a kernel's passes, and it
adds it unevenly, so a disturbed timing can crown the wrong kernel.

Plausible: a kernel that streams its weight (a one-row GEMV) must read a weight too big for the
caches at no less than a fraction of what a plain fp32 sum streams on this machine, and at no
less than a fraction of what the same kernel streams on another such shape. A spoiled choice
(every candidate timed at a twentieth of its speed while other work shared the cores) fails both.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from pocketllm.startup import stat_fields

# Other processes' CPU time, and stolen time, as shares of the window's capacity (CPUs x wall)
# beyond which a timing is disturbed; below MIN_TICKS clock ticks nothing is concluded (the
# counters move in ticks, and a short window's background noise is a tick or two).
OTHERS_SHARE = 0.10
STEAL_SHARE = 0.05
MIN_TICKS = 4
# Plausibility, for weights of at least PLAUSIBLE_BYTES: the best kernel of a streaming kind reads
# at least READ_FRACTION of the machine's read rate, and no shape runs slower than SHAPE_FRACTION
# of the fastest rate among such shapes.
PLAUSIBLE_BYTES = 1 << 20
READ_FRACTION = 1 / 8
SHAPE_FRACTION = 1 / 6

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Verdict:
    disturbed: bool
    others: float  # other processes' CPU time, share of capacity
    steal: float
    seconds: float
    known: bool = True  # False where /proc/stat cannot be read: nothing could be concluded

    def describe(self) -> str:
        if not self.known:
            return "machine load unknown"
        return f"other processes took {100 * self.others:.0f}% of the CPUs, {100 * self.steal:.0f}% stolen"


def _proc_stat() -> tuple[int, int, int] | None:
    """(busy ticks, steal ticks, CPUs) summed over the machine's CPUs."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    fields = [int(v) for v in lines[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    return user + nice + system + irq + softirq, steal, max(cpus, 1)


def _process_ticks(pid: int | str) -> int:
    """utime + stime of a process, all its threads, in clock ticks (0 if it is gone)."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return 0
    # Fields 14 and 15.
    return int(fields[11]) + int(fields[12])


class Monitor:
    """Times windows of this process's work and judges each: with `peers` (the pids of this
    process's sibling ranks), their CPU time counts as this process's own. The shares are the
    thresholds (OTHERS_SHARE, STEAL_SHARE unless given)."""

    def __init__(self, peers=(), others_share: float = OTHERS_SHARE, steal_share: float = STEAL_SHARE):
        self.peers = tuple(p for p in peers if p != os.getpid())
        self.others_share, self.steal_share = others_share, steal_share

    def _own(self) -> int:
        return _process_ticks("self") + sum(_process_ticks(p) for p in self.peers)

    def start(self):
        return time.perf_counter(), _proc_stat(), self._own()

    def stop(self, started) -> Verdict:
        t0, stat0, own0 = started
        seconds = time.perf_counter() - t0
        stat1, own1 = _proc_stat(), self._own()
        if stat0 is None or stat1 is None:
            return Verdict(False, 0.0, 0.0, seconds, known=False)
        capacity = max(seconds * _TICK * stat1[2], 1e-9)
        others = max(0, (stat1[0] - stat0[0]) - (own1 - own0))
        steal = max(0, stat1[1] - stat0[1])
        disturbed = others >= max(MIN_TICKS, self.others_share * capacity) or steal >= max(MIN_TICKS, self.steal_share * capacity)
        return Verdict(disturbed, others / capacity, steal / capacity, seconds)


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache the kernel reports for CPU 0, None where it reports none."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in os.listdir(base):
            with open(f"{base}/{index}/size") as f:
                text = f.read().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
            best = size if best is None else max(best, size)
    except (OSError, ValueError):
        pass
    return best


def read_rate_gbps(monitor: Monitor, reps: int = 5) -> tuple[float, Verdict]:
    """This machine's read rate: the best of `reps` fp32 sums over a buffer four times the last
    level cache (64 MiB to 512 MiB), on torch's threads as the kernels run; and whether the
    machine was quiet meanwhile."""
    llc = last_level_cache_bytes() or (64 << 20)
    n = min(max(4 * llc, 64 << 20), 512 << 20) // 4
    buf = torch.ones(n, dtype=torch.float32)
    buf.sum()
    started = monitor.start()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best / 1e9, monitor.stop(started)


def implausible(seconds: dict, nbytes: dict, read_rate=None) -> dict:
    """The keys whose best time is implausible, with why: seconds {key: {kernel: s}}, nbytes {key:
    bytes one call streams}, read_rate() the machine's read rate in GB/s (None: not compared).
    Only keys of at least PLAUSIBLE_BYTES are judged."""
    rates = {k: nbytes[k] / min(s.values()) / 1e9 for k, s in seconds.items() if nbytes.get(k, 0) >= PLAUSIBLE_BYTES and s}
    if not rates:
        return {}
    read_gbps = read_rate() if read_rate is not None else None
    fastest = max(rates.values())
    bad = {}
    for k, rate in rates.items():
        if read_gbps and rate < READ_FRACTION * read_gbps:
            bad[k] = f"{rate:.1f} GB/s against a read rate of {read_gbps:.1f}"
        elif rate < SHAPE_FRACTION * fastest:
            bad[k] = f"{rate:.1f} GB/s against {fastest:.1f} on another shape"
    return bad

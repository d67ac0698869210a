"""The host's cores as the kernel describes them in sysfs (SMT siblings, NUMA nodes), and the map
of cores the launcher pins its ranks to: whole physical cores per rank, all on one node where the
ranks fit per node, one torch thread per physical core; and the binding of a rank's memory to its
node(s) on a host with more than one. Reads no torch, so the launcher plans before any rank starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import re
from dataclasses import dataclass

from pocketllm.errors import UsageError

SYSFS = "/sys"


@dataclass(frozen=True)
class Core:
    """One physical core: its NUMA node and the logical CPUs of it a process may use."""

    node: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class RankCpus:
    """What one rank is pinned to: its CPUs, how many physical cores they are (its torch threads),
    and the NUMA nodes they lie on."""

    cpus: tuple[int, ...]
    cores: int
    nodes: tuple[int, ...]


def parse_cpulist(text: str, what: str) -> list[int]:
    """The kernel's cpulist format: "0-3,8,10-11" (sysfs files, taskset -c, --cpus)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise UsageError(f"{what}: {part.strip()!r} is not a CPU number or range (expected a list such as 0-3,8,10-11)")
        first = int(m.group(1))
        cpus.extend(range(first, int(m.group(2) or first) + 1))
    return sorted(set(cpus))


def format_cpulist(cpus) -> str:
    """The shortest cpulist of `cpus`: [0, 1, 2, 5] -> "0-2,5"."""
    parts, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [c]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_cores(cpus, sysfs: str | None = None) -> list[Core]:
    """The physical cores holding `cpus`, each with those of its SMT siblings in `cpus`, ordered by
    node and then by first CPU. A CPU whose sysfs entries are missing is its own core on node 0:
    without the files (a container hiding /sys, another OS) this is the plain list of CPUs."""
    root = sysfs or SYSFS
    allowed = set(cpus)
    node_of: dict[int, int] = {}
    for path in glob.glob(os.path.join(root, "devices/system/node/node*/cpulist")):
        node = int(re.search(r"node(\d+)/cpulist$", path).group(1))
        text = _read(path)
        for c in parse_cpulist(text, path) if text else []:
            node_of[c] = node
    seen: set[int] = set()
    cores = []
    for c in sorted(allowed):
        if c in seen:
            continue
        topo = os.path.join(root, f"devices/system/cpu/cpu{c}/topology")
        text = _read(os.path.join(topo, "core_cpus_list")) or _read(os.path.join(topo, "thread_siblings_list"))
        siblings = set(parse_cpulist(text, topo)) & allowed if text else set()
        siblings.add(c)
        seen |= siblings
        cores.append(Core(node_of.get(c, 0), tuple(sorted(siblings))))
    return sorted(cores, key=lambda core: (core.node, core.cpus[0]))


def physical_cores(cpus, sysfs: str | None = None) -> int:
    return len(read_cores(cpus, sysfs))


def _rank(cores: list[Core]) -> RankCpus:
    return RankCpus(tuple(sorted(c for core in cores for c in core.cpus)), len(cores), tuple(sorted({core.node for core in cores})))


def plan_ranks(world: int, cores: list[Core]) -> list[RankCpus]:
    """The cores of each of `world` ranks, all the same number, since a TP group waits for its
    slowest rank (the cores left over stay idle):
    - fewer ranks than nodes: each rank takes whole nodes (memory then spans only its own);
    - else the most cores per rank such that every rank's lie on one node, ranks filling node 0
      first, then node 1, ...;
    - fewer physical cores than ranks: rank r shares core r mod cores with the others on it."""
    if len(cores) < world:
        return [_rank([cores[r % len(cores)]]) for r in range(world)]
    by_node: dict[int, list[Core]] = {}
    for core in cores:
        by_node.setdefault(core.node, []).append(core)
    nodes = list(by_node.values())
    if world < len(nodes):
        per = len(nodes) // world
        groups = [[core for node in nodes[r * per : (r + 1) * per] for core in node] for r in range(world)]
        size = min(len(g) for g in groups)
        return [_rank(g[:size]) for g in groups]
    size = max(k for k in range(1, len(cores) + 1) if sum(len(n) // k for n in nodes) >= world)
    ranks = []
    for node in nodes:
        for i in range(len(node) // size):
            if len(ranks) < world:
                ranks.append(_rank(node[i * size : (i + 1) * size]))
    return ranks


def given_ranks(text: str, world: int, allowed, what: str, sysfs: str | None = None) -> list[RankCpus]:
    """--cpus / POCKETLLM_CPUS: one cpulist per rank separated by '/' (0-3/4-7), or one cpulist
    that plan_ranks shares out among the ranks. Every CPU must be one this process may run on."""
    lists = text.split("/")
    if len(lists) not in (1, world):
        raise UsageError(f"{what} {text}: {len(lists)} lists for {world} ranks; give one per rank (separated by '/') or one for all")
    parsed = [parse_cpulist(part, f"{what} {text}") for part in lists]
    outside = sorted({c for cpus in parsed for c in cpus} - set(allowed))
    if outside:
        raise UsageError(f"{what} {text}: CPU {format_cpulist(outside)} is not one this process may run on ({format_cpulist(allowed)})")
    if len(parsed) == 1:
        return plan_ranks(world, read_cores(parsed[0], sysfs))
    return [_rank(read_cores(cpus, sysfs)) for cpus in parsed]


def describe(ranks: list[RankCpus], cores: list[Core]) -> str:
    """The map in one line, printed once by the launcher."""
    nodes = sorted({core.node for core in cores})
    smt = max(len(core.cpus) for core in cores)
    host = (
        f"{len(nodes)} NUMA node{'s' if len(nodes) != 1 else ''}, {len(cores)} core{'s' if len(cores) != 1 else ''}, "
        + (f"SMT {smt}-way" if smt > 1 else "no SMT")
    )
    parts = []
    for r, rank in enumerate(ranks):
        where = f" (node {','.join(map(str, rank.nodes))})" if len(nodes) > 1 else ""
        parts.append(f"rank {r} CPU{'s' if len(rank.cpus) > 1 else ''} {format_cpulist(rank.cpus)}{where}")
    threads = sorted({rank.cores for rank in ranks})
    each = f"{threads[0]} torch thread{'s' if threads[0] != 1 else ''}" if len(threads) == 1 else f"{'/'.join(map(str, threads))} torch threads"
    return f"pinned {len(ranks)} ranks on {host}: {', '.join(parts)}; {each} per rank"


MPOL_BIND = 2
# set_mempolicy's number where glibc has no wrapper and libnuma is not installed.
_SYSCALL = {"x86_64": 238, "aarch64": 237, "ppc64le": 260, "s390x": 270}


def memory_binder():
    """(bind, None): bind(nodes) sets the calling process's memory policy to MPOL_BIND on those
    nodes (as numactl --membind does); or (None, why not) where neither libnuma's set_mempolicy
    nor the system call's number is known. Made before fork: bind runs between fork and exec."""
    fn = None
    path = ctypes.util.find_library("numa")
    if path is not None:
        try:
            fn = ctypes.CDLL(path, use_errno=True).set_mempolicy
        except (OSError, AttributeError):
            fn = None
    if fn is None:
        number = _SYSCALL.get(platform.machine())
        if number is None:
            return None, f"no libnuma and no known set_mempolicy system call on {platform.machine()}"
        syscall = ctypes.CDLL(None, use_errno=True).syscall

        def fn(mode, mask, maxnode):
            return syscall(number, mode, mask, maxnode)

    def bind(nodes) -> int:
        """0, or the errno of a refusal."""
        words = max(nodes) // 64 + 1
        mask = (ctypes.c_ulong * words)()
        for n in nodes:
            mask[n // 64] |= 1 << (n % 64)
        if fn(MPOL_BIND, mask, ctypes.c_ulong(words * 64 + 1)) != 0:
            return ctypes.get_errno() or -1
        return 0

    return bind, None


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field (MemTotal, MemAvailable, ...) in bytes; 0 where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

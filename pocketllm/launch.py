"""Starting local ranks and ending them: the launcher. `--tp-world N` alone makes this process
start N ranks of the same command (re-run with the rank and the run plan in the environment, each pinned to its own
whole cores, on one NUMA node where the ranks fit per node: pocketllm/topology.py), rendezvous
through a fresh private directory, watch them, and stop them all when one fails or the launcher
gets SIGINT/SIGTERM. Its last line names the failure that ended the run
(pocketllm/rank_failures.py); what each rank runs is pocketllm/rank.py. Under torchrun, or with ranks
started by hand, no launcher runs: each process is one rank.

torch.distributed.elastic's process starting (multiprocessing.start_processes) and error files
(errors.record) were weighed against this, as torch 2.13's source has them, and not used:
they would lose what tests/test_faults.py and benchmarks/fault_timing.py measure:
- no orphans when the launcher is killed outright: elastic starts each worker in a new session
  with no parent-death signal, so SIGKILL to the launcher leaves its ranks running; here each
  rank gets PR_SET_PDEATHSIG before exec;
- a dead rank ends the run in about half a second: PContext.wait polls every `period` seconds
  (1 s by default); here the launcher sleeps on each rank's pidfd and wakes when one ends;
- cores: start_processes takes no pre-exec hook, so a rank could only pin itself after Python
  and torch have started their threads; here the affinity is set between fork and exec;
- the right rank named: elastic reports the failure with the smallest error-file timestamp, in
  whole seconds, and a rank killed by a signal gets the time its end was noticed; a rank that lost
  its peer often fails first, so here the failure least likely to follow from another's is named
  (rank_failures.first_failure) from one-line reports, where an error file holds a traceback.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import time

from pocketllm import rank_failures, topology
from pocketllm.device_kind import ENV_PIN_CPUS, ENV_RANK_CPUS, allowed_cpus
from pocketllm.distributed import rendezvous, waiting
from pocketllm.errors import UsageError
from pocketllm.interrupts import STOPS
from pocketllm.run_plan import ENV_PLAN, RunPlan
from pocketllm.switches import env_switch, env_value

ENV_RANK = "POCKETLLM_LAUNCH_RANK"
ENV_WORLD = "POCKETLLM_LAUNCH_WORLD"
ENV_RDZV = "POCKETLLM_LAUNCH_RDZV"
# The file holding what the launcher's check returned (the model plan and the command's inputs),
# which rank 0 shares with the others instead of checking the same inputs again.
ENV_CHECKED = "POCKETLLM_LAUNCH_CHECKED"
# The cores of the ranks the launcher starts, as --cpus takes them.
ENV_CPUS = "POCKETLLM_CPUS"
# The pinning map, given to rank 0 to print once it runs: after a rank's own checks, so that a
# usage error a rank finds stays the one line of its output.
ENV_PIN_MAP = "POCKETLLM_LAUNCH_PIN_MAP"
# The most a rank gets to end after SIGTERM before it is killed.
TERMINATE_GRACE_SECONDS = 3.0
# The most the launcher waits for the rank it names to finish exiting on its own.
ROOT_CAUSE_WAIT_SECONDS = 1.0


def spawn_local_ranks(run: RunPlan, forward_signals: float = 0.0, checked=None) -> int:
    """Start the plan's world of ranks of its command, each given the plan (ENV_PLAN) rather than
    the command line and `checked`, what the launcher's check of its inputs returned (ENV_CHECKED),
    and supervise them. When one fails, stop the rest and name the first failure; on
    SIGINT/SIGTERM stop every rank. With forward_signals (seconds, > 0) the first SIGINT/SIGTERM
    goes to rank 0 instead, which ends the run itself (every rank exiting 0 is a clean exit, 0); a
    second signal, or the ranks still running that many seconds later (rank 0 stuck in a
    collective a hung peer never joins), stops them all. The plan's cpus are --cpus (else
    POCKETLLM_CPUS; else the launcher plans the map from its own cores). Returns the exit
    status."""
    world, cpus, plan_json = run.world.size, run.world.cpus, run.to_json()
    # Read here only so that a bad value starts no rank; each rank reads it for its own backend.
    env_switch(os.environ, waiting.ENV_POLL, default=True)
    ranks, line = pin_map(world, cpus)
    shares = [None] * world if ranks is None else [list(r.cpus) for r in ranks]
    bind, memory = _memory_binding(ranks)
    rdzv_dir = rendezvous.private_dir()
    procs: list[subprocess.Popen] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signals: list[int] = []

    def on_signal(signum, _frame):
        signals.append(signum)
        try:
            os.write(wake_w, b"!")
        except BlockingIOError:
            pass

    # SIGHUP too: a closed terminal stops the run as `kill` does, and the directory is removed.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, *STOPS)}
    try:
        checked_path = _write_checked(rdzv_dir, checked)
        for rank, cpus in enumerate(shares):
            env = dict(
                os.environ,
                **{ENV_RANK: str(rank), ENV_WORLD: str(world), ENV_RDZV: os.path.join(rdzv_dir, "store"), rank_failures.ENV_REPORT: rank_failures.report_path(rdzv_dir, rank)},
                **{ENV_PLAN: plan_json, ENV_CHECKED: checked_path},
            )
            if cpus is not None:
                env[ENV_RANK_CPUS] = topology.format_cpulist(cpus)
            if rank == 0 and line is not None:
                env[ENV_PIN_MAP] = line + memory
            nodes = ranks[rank].nodes if bind is not None else None
            preexec = _rank_preexec(os.getpid(), cpus, bind, nodes)
            # stdin closed: a rank in its own process group must never stop on a terminal read.
            # The command's name alone on the command line, for whoever lists the processes: the
            # rank takes its settings from the plan.
            procs.append(subprocess.Popen([sys.executable, "-m", "pocketllm", run.command], env=env, stdin=subprocess.DEVNULL, preexec_fn=preexec))
        outcome = _supervise(procs, wake_r, signals, rdzv_dir, forward_signals)
        _stop(procs)
        if outcome is None:
            return 0
        if isinstance(outcome, str):
            print(f"pocketllm: error: got {outcome}; stopped every rank", file=sys.stderr, flush=True)
            return 128 + getattr(signal, outcome)
        rank, stopped = outcome
        line, status = rank_failures.failed_rank_line(rank, procs[rank].returncode, rank_failures.read_report(rdzv_dir, rank), stopped,
                                                      run.device.backend)
        if line:
            print(line, file=sys.stderr, flush=True)
        return status
    finally:
        _stop(procs)
        for s, handler in old.items():
            signal.signal(s, handler)
        os.close(wake_r)
        os.close(wake_w)
        shutil.rmtree(rdzv_dir, ignore_errors=True)


def _write_checked(rdzv_dir: str, checked) -> str:
    # Pickled, as rank 0 shares it over the process group, into the launcher's private directory:
    # only this user can write there, and the directory ends with the run.
    path = os.path.join(rdzv_dir, "checked")
    with open(path, "wb") as f:
        pickle.dump(checked, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def launcher_checked(env=os.environ):
    """(True, what the launcher's check returned) in a rank the launcher started, else (False, None)."""
    path = env_value(env, ENV_CHECKED)
    if not path:
        return False, None
    with open(path, "rb") as f:
        return True, pickle.load(f)


def _supervise(procs: list[subprocess.Popen], wake_fd: int, signals: list[int], rdzv_dir: str, forward: float = 0.0):
    """Wait on every rank's pidfd (a sentinel that becomes readable when the rank ends) and on the
    signal pipe. Returns None when all ranks succeed, the first failure as _first_failure gives
    it, or the name of the signal that stopped the launcher (see spawn_local_ranks for forward)."""
    sentinels = _pidfds(procs)
    forwarded_at = None
    try:
        while True:
            if signals and forward and forwarded_at is None:
                forwarded_at = time.monotonic()
                if procs[0].poll() is None:
                    procs[0].send_signal(_passed_on(signals[0]))
            elif signals and (not forward or len(signals) > 1 or time.monotonic() - forwarded_at > forward):
                return signal.Signals(signals[0]).name
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed and forwarded_at is not None and procs[0].returncode in (-_passed_on(signals[0]), 128 + _passed_on(signals[0]), 130):
                # Rank 0 ended of the signal passed on to it, before it could take it as a stop
                # (still starting): the run was stopped, not failed.
                return signal.Signals(signals[0]).name
            if failed:
                return _first_failure(procs, failed, rdzv_dir)
            if all(p.returncode == 0 for p in procs):
                return None
            for fd, rank in list(sentinels.items()):
                if procs[rank].returncode is not None:
                    del sentinels[fd]
                    os.close(fd)
            # Without pidfds (old kernels) this degrades to polling every 50 ms.
            ready, _, _ = select.select([*sentinels, wake_fd], [], [], 1.0 if sentinels else 0.05)
            if wake_fd in ready:
                os.read(wake_fd, 64)
    finally:
        for fd in sentinels:
            os.close(fd)


def _passed_on(signum: int) -> int:
    """The signal rank 0 gets for one the launcher got: SIGHUP as SIGTERM, which rank 0 (serve)
    takes as a stop."""
    return signal.SIGTERM if signum == signal.SIGHUP else signum


def _pidfds(procs: list[subprocess.Popen]) -> dict[int, int]:
    fds: dict[int, int] = {}
    for rank, p in enumerate(procs):
        try:
            fds[os.pidfd_open(p.pid)] = rank
        except (AttributeError, OSError):
            for fd in fds:
                os.close(fd)
            return {}
    return fds


def _first_failure(procs: list[subprocess.Popen], failed: list[int], rdzv_dir: str) -> tuple[int, bool]:
    """The rank to name (rank_failures.first_failure), given a moment to finish exiting so its own exit
    status is reported. Returns the rank and whether it was still running after that moment."""
    reports = {r: rank_failures.read_report(rdzv_dir, r) for r in range(len(procs))}
    rank = rank_failures.first_failure([p.returncode for p in procs], failed, reports)
    try:
        procs[rank].wait(timeout=ROOT_CAUSE_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        return rank, True
    return rank, False


def pin_map(
    world: int, cpus: str | None = None, env=os.environ, sysfs: str | None = None, allowed: list[int] | None = None
) -> tuple[list[topology.RankCpus] | None, str | None]:
    """The cores each rank the launcher starts is pinned to (pocketllm/topology.py) and the map as
    one line, which rank 0 prints; (None, None) when the ranks run unpinned (POCKETLLM_PIN_CPUS=0,
    or no CPU affinity on this OS). The launcher shares out the cores it may run on: to run two
    launches side by side, give each its own (taskset -c, or --cpus). `allowed` is this process's
    CPUs (its affinity unless given)."""
    pin = env_switch(env, ENV_PIN_CPUS, default=True)
    flag, given = ("--cpus", cpus) if cpus is not None else (ENV_CPUS, env_value(env, ENV_CPUS).strip() or None)
    if given is not None and not pin:
        raise UsageError(f"{flag} pins the ranks and {ENV_PIN_CPUS}=0 says not to: drop one")
    if not pin or not hasattr(os, "sched_setaffinity"):
        return None, None
    mine = allowed_cpus() if allowed is None else allowed
    if given is not None:
        ranks = topology.given_ranks(given, world, mine, flag, sysfs)
    else:
        ranks = topology.plan_ranks(world, topology.read_cores(mine, sysfs))
    return ranks, f"pocketllm: {topology.describe(ranks, topology.read_cores(mine, sysfs))}"


def _memory_binding(ranks: list[topology.RankCpus] | None):
    """On a host of several NUMA nodes, the function that binds a rank's memory to its nodes, or
    None; and what the map line adds about memory ("" on one node, where a pinned rank's pages
    are local anyway)."""
    if ranks is None or len({n for r in ranks for n in r.nodes}) < 2:
        return None, ""
    bind, why_not = topology.memory_binder()
    if bind is None:
        return None, f"; each rank's memory left to first touch on its node(s): {why_not}"
    return bind, "; each rank's memory bound to its node(s) (MPOL_BIND)"


def _rank_preexec(launcher_pid: int, cpus: list[int] | None, bind=None, nodes=None):
    """Runs in each rank between fork and exec: its own process group (a Ctrl-C reaches only the
    launcher, which then stops the ranks), death with the launcher if that is killed outright, its
    cores, set before exec so that every thread the rank starts inherits them, and on a host of
    several NUMA nodes its memory policy, inherited the same way."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        prctl = None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        os.setpgid(0, 0)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if bind is not None and nodes:
            err = bind(nodes)
            if err:
                os.write(2, f"pocketllm: warning: a rank's memory could not be bound to node(s) {nodes}: {os.strerror(err)}\n".encode())
        if prctl is not None:
            prctl(pr_set_pdeathsig, signal.SIGKILL)
        # The launcher may have died before prctl took effect.
        if os.getppid() != launcher_pid:
            os._exit(1)

    return preexec


def _stop(procs: list[subprocess.Popen]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

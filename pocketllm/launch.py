"""Starting ranks and ending them. Three ways, one entry point:
- `--tp-world N` alone: this process starts N local ranks (re-running the same command with a
  rank in the environment), rendezvous through a fresh private directory, and supervises them:
  the first rank to fail stops the others and is named in one line;
- under torchrun: RANK / WORLD_SIZE / LOCAL_RANK come from the environment (env:// rendezvous);
- by hand, one process per rank: `--tp-world N --tp-rank i --rendezvous-file FILE` (file rendezvous).

Each rank leaves the launcher a one-line report of how it failed (a JSON file in the private
directory), so the launcher's last line says why, not only that, a rank ended.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist

from pocketllm.device import ENV_PIN_CPUS, ENV_RANK_CPUS, allowed_cpus, cpu_shares
from pocketllm.distributed import collective, rendezvous, waiting
from pocketllm.distributed.state import set_tp
from pocketllm.errors import UsageError
from pocketllm.switches import env_switch

ENV_RANK = "POCKETLLM_LAUNCH_RANK"
ENV_WORLD = "POCKETLLM_LAUNCH_WORLD"
ENV_RDZV = "POCKETLLM_LAUNCH_RDZV"
ENV_REPORT = "POCKETLLM_LAUNCH_REPORT"
# The most a rank gets to end after SIGTERM before it is killed.
TERMINATE_GRACE_SECONDS = 3.0
# The most the launcher waits for the rank it names to finish exiting on its own.
ROOT_CAUSE_WAIT_SECONDS = 1.0
# When two failures are seen at once, the one least likely to follow from another comes first:
# a death by signal or an exit without a report (nothing a peer does causes those), then an
# exception or a user error (any other kind: 1), then a timed-out collective, then a lost peer.
_CONSEQUENCE = {"timeout": 2, "peer": 3}


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int
    file_store: str | None = None  # the launcher's private FileStore
    id_path: str | None = None  # the hand-started rendezvous file


def rank_env(tp_world: int | None, tp_rank: int | None, id_path: str | None, env=os.environ, default_world: int = 1) -> RankEnv | None:
    """This process's place in the run, or None when it must start the ranks itself. tp_world None
    means --tp-world was not given: torchrun's WORLD_SIZE, else `default_world`."""
    if ENV_RANK in env:
        world = int(env[ENV_WORLD])
        return RankEnv(int(env[ENV_RANK]), world, int(env[ENV_RANK]), world, file_store=env[ENV_RDZV])
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        if tp_world not in (None, world):
            raise UsageError(f"--tp-world {tp_world} disagrees with torchrun's WORLD_SIZE={world}")
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return RankEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world)
    if tp_world is None:
        tp_world = default_world
    if tp_rank is not None:
        if not 0 <= tp_rank < tp_world:
            raise UsageError(f"--tp-rank must be in 0..{tp_world - 1}, got {tp_rank}")
        if not id_path:
            raise UsageError("--tp-rank needs --rendezvous-file FILE, the rendezvous file every rank names")
        return RankEnv(tp_rank, tp_world, tp_rank, tp_world, id_path=os.path.abspath(id_path))
    if tp_world == 1:
        return RankEnv(0, 1, 0, 1)
    return None


# Where this rank is, for the line a failed collective leaves.
_where = {"place": "starting", "timeout_s": None}


def init_distributed(renv: RankEnv, backend: str, timeout_s: float) -> None:
    set_tp(renv.rank, renv.world)
    _where["timeout_s"] = timeout_s
    if renv.world == 1:
        return
    waiting.configure(backend)
    _where["place"] = "the rendezvous"
    rendezvous.join_group(backend, renv.rank, renv.world, timeout_s, renv.file_store, renv.id_path)
    _where["place"] = "loading"


def setup_collective(renv: RankEnv, choice: str, backend: str) -> None:
    """Choose the engine's all-reduce (pocketllm.distributed.collective) once the group runs on
    checked inputs; its waits honour the same --dist-timeout as the group's."""
    if renv.world == 1:
        return
    _where["place"] = "setting up the all-reduce"
    collective.setup(choice, backend, renv.rank, renv.world, _where["timeout_s"])
    _where["place"] = "loading"


def shutdown_distributed() -> None:
    collective.close()
    rendezvous.leave_group()


class _PassPlace:
    """A pass as a place, put into words only if a collective fails in it."""

    __slots__ = ("info", "after")

    def __init__(self, info, after: bool):
        self.info, self.after = info, after

    def __str__(self) -> str:
        return f"{'after ' if self.after else ''}{self.info.kind} pass {self.info.index}"


class PassTracker:
    """A pass hook that remembers where this rank is, so a failed collective can say where. It
    runs around every decode step, so it only keeps the pass; the words are made on failure."""

    def before_pass(self, info) -> None:
        _where["place"] = _PassPlace(info, after=False)

    def after_pass(self, info) -> None:
        _where["place"] = _PassPlace(info, after=True)


class RefusedByRank0(UsageError):
    """Rank 0 found the inputs bad and said so; this rank stops quietly with it."""


def checked_on_rank0(renv: RankEnv, check, join):
    """Rank 0 runs check(), once, and every rank gets its result (or its one-line error) over the
    process group that join() sets up, so all ranks run on the same checked inputs or all stop."""
    verdict = None
    if renv.rank == 0:
        try:
            verdict = (True, check())
        except UsageError as exc:
            verdict = (False, str(exc))
    try:
        join()
    except Exception:
        if verdict is not None and not verdict[0]:
            raise UsageError(verdict[1]) from None
        raise
    if renv.world > 1:
        _where["place"] = "sharing rank 0's checked inputs"
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
        _where["place"] = "loading"
    ok, value = verdict
    if not ok:
        raise (UsageError if renv.rank == 0 else RefusedByRank0)(value)
    return value


def collective_failure(exc: BaseException) -> str | None:
    """"timeout" or "peer" when exc is a collective that timed out or lost a peer, else None. By
    type where torch says it (a network error is a lost peer); gloo raises a plain RuntimeError
    for both (torch 2.13: "Timed out waiting 2000ms for recv operation", "Connection closed by
    peer"), so there only the message tells them apart. On NCCL/HCCL a timed-out collective
    raises nothing: the backend's watchdog aborts the process (_describe_exit says so)."""
    # The shared-memory all-reduce says which it was.
    kind = getattr(exc, "collective_kind", None)
    if kind is not None:
        return kind
    if isinstance(exc, dist.DistNetworkError):
        return "peer"
    text = str(exc).lower()
    if not (isinstance(exc, dist.DistError) or any(b in text for b in ("gloo", "nccl", "hccl", "store"))):
        return None
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(m in text for m in ("closed by peer", "reset by peer", "broken pipe", "connection refused", "econnreset")):
        return "peer"
    return None


def run_rank(renv: RankEnv, body) -> int:
    """Run this rank's part, then leave the process group. A failure becomes one line: written for
    the launcher when there is one, else printed. Collective failures end the rank with exit 1 and
    no traceback; other exceptions keep theirs (the launcher still names them). The line is
    written before the group is left: peers notice a rank leave at once, and the launcher must
    already know which rank failed first."""
    launched = ENV_REPORT in os.environ
    try:
        return body()
    except RefusedByRank0 as exc:
        _leave_report("usage", str(exc))
        return 2
    except UsageError as exc:
        if not launched:
            raise
        _leave_report("usage", str(exc))
        return 2
    except Exception as exc:
        kind = collective_failure(exc)
        if kind is None:
            _leave_report("exception", traceback.format_exception_only(exc)[-1].strip())
            raise
        line = _collective_line(kind)
        _leave_report(kind, line)
        if not launched:
            print(f"pocketllm: error: rank {renv.rank}: {line}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown_distributed()


def _collective_line(kind: str) -> str:
    place, timeout_s = _where["place"], _where["timeout_s"]
    if kind == "timeout" and str(place) == "the rendezvous":
        return f"the rendezvous timed out after {timeout_s:g} s (--dist-timeout): not every rank joined"
    if kind == "timeout":
        return (
            f"a collective it waited for in {place} timed out after {timeout_s:g} s (--dist-timeout): "
            f"another rank never joined it; it hung, died, or is slower than the timeout"
        )
    return f"lost its connection to another rank in {place}: that rank died or exited"


def _leave_report(kind: str, line: str) -> None:
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"kind": kind, "line": line, "time": time.time()}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def spawn_local_ranks(world: int, argv: list[str]) -> int:
    """Start `world` ranks of this same command and supervise them. When one fails, stop the rest
    and name the first failure; on SIGINT/SIGTERM stop every rank. Returns the exit status."""
    # The launcher splits the cores it may run on among its ranks; to run two launches side by
    # side, give each its own cores (taskset -c).
    pin = hasattr(os, "sched_setaffinity") and env_switch(os.environ, ENV_PIN_CPUS, default=True)
    # Read here only so that a bad value starts no rank; each rank reads it for its own backend.
    env_switch(os.environ, waiting.ENV_POLL, default=True)
    shares = cpu_shares(world, allowed_cpus()) if pin else [None] * world
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

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank, cpus in enumerate(shares):
            env = dict(
                os.environ,
                **{ENV_RANK: str(rank), ENV_WORLD: str(world), ENV_RDZV: os.path.join(rdzv_dir, "store"), ENV_REPORT: _report_path(rdzv_dir, rank)},
            )
            if cpus is not None:
                env[ENV_RANK_CPUS] = ",".join(map(str, cpus))
            preexec = _rank_preexec(os.getpid(), cpus)
            # stdin closed: a rank in its own process group must never stop on a terminal read.
            procs.append(subprocess.Popen([sys.executable, "-m", "pocketllm", *argv], env=env, stdin=subprocess.DEVNULL, preexec_fn=preexec))
        outcome = _supervise(procs, wake_r, signals, rdzv_dir)
        _stop(procs)
        if outcome is None:
            return 0
        if isinstance(outcome, str):
            print(f"pocketllm: error: got {outcome}; stopped every rank", file=sys.stderr, flush=True)
            return 128 + getattr(signal, outcome)
        rank, stopped = outcome
        report = _read_report(rdzv_dir, rank)
        if report and report["kind"] == "usage":
            print(f"pocketllm: error: {report['line']}", file=sys.stderr, flush=True)
            return 2
        # A rank stopped by the launcher still exiting: its report says why, the signal would not.
        how = "" if stopped and report else f" ({_describe_exit(procs[rank].returncode)})"
        detail = f": {report['line']}" if report else ""
        print(f"pocketllm: error: rank {rank} failed{how}{detail}", file=sys.stderr, flush=True)
        return 1
    finally:
        _stop(procs)
        for s, handler in old.items():
            signal.signal(s, handler)
        os.close(wake_r)
        os.close(wake_w)
        shutil.rmtree(rdzv_dir, ignore_errors=True)


def _supervise(procs: list[subprocess.Popen], wake_fd: int, signals: list[int], rdzv_dir: str):
    """Wait on every rank's pidfd (a sentinel that becomes readable when the rank ends) and on the
    signal pipe. Returns None when all ranks succeed, the first failure as _first_failure gives
    it, or the name of the signal that stopped the launcher."""
    sentinels = _pidfds(procs)
    try:
        while True:
            if signals:
                return signal.Signals(signals[0]).name
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
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
    """The rank whose failure caused the others'. A rank that lost a peer or timed out may exit
    before the rank that raised and broke the group; the raiser has left its report by then, so
    it is named, and given a moment to finish exiting so its own exit status is reported.
    Returns the rank and whether it was still running after that moment."""
    reports = {r: _read_report(rdzv_dir, r) for r in range(len(procs))}
    suspects = set(failed) | {r for r, rep in reports.items() if rep and _consequence(None, rep) <= 1}
    # Ties go to the earlier report: the ranks share one clock.
    rank = min(suspects, key=lambda r: (_consequence(procs[r].returncode, reports[r]), (reports[r] or {}).get("time", 0.0), r))
    try:
        procs[rank].wait(timeout=ROOT_CAUSE_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        return rank, True
    return rank, False


def _consequence(code: int | None, report: dict | None) -> int:
    """0 for a failure surely of its own, higher the likelier it follows from another rank's."""
    if (code is not None and code < 0) or report is None:
        return 0
    return _CONSEQUENCE.get(report["kind"], 1)


def _report_path(rdzv_dir: str, rank: int) -> str:
    return os.path.join(rdzv_dir, f"rank{rank}.report")


def _read_report(rdzv_dir: str, rank: int) -> dict | None:
    try:
        with open(_report_path(rdzv_dir, rank)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _describe_exit(code: int) -> str:
    if code == -signal.SIGABRT:
        # NCCL's (and HCCL's) watchdog aborts a rank whose collective timed out or failed.
        return "killed by signal SIGABRT: on NCCL/HCCL, the watchdog's abort after a collective timed out or failed"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _rank_preexec(launcher_pid: int, cpus: list[int] | None):
    """Runs in each rank between fork and exec: its own process group (a Ctrl-C reaches only the
    launcher, which then stops the ranks), death with the launcher if that is killed outright, and
    its cores, set before exec so that every thread the rank starts inherits them."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        prctl = None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        os.setpgid(0, 0)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
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

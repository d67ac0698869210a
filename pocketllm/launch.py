"""Starting ranks. Three ways, one entry point:
- `--tp-world N` alone: this process starts N local ranks (re-running the same command with a
  rank in the environment), rendezvous through a fresh private directory, and supervises them;
- under torchrun: RANK / WORLD_SIZE / LOCAL_RANK come from the environment (env:// rendezvous);
- by hand, one process per rank: `--tp-world N --tp-rank i --nccl-id-path FILE` (file rendezvous).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from pocketllm.distributed.state import set_tp
from pocketllm.errors import UsageError

ENV_RANK = "POCKETLLM_LAUNCH_RANK"
ENV_WORLD = "POCKETLLM_LAUNCH_WORLD"
ENV_RDZV = "POCKETLLM_LAUNCH_RDZV"
ENV_WAIT_ATTEMPTS = "POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS"
# One rendezvous wait attempt, as the hand-started mode counts them.
WAIT_ATTEMPT_SECONDS = 0.01
DEFAULT_WAIT_ATTEMPTS = 12_000
TERMINATE_GRACE_SECONDS = 3.0


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int
    init_method: str | None  # None at world size 1
    file_store: str | None = None


def rank_env(tp_world: int, tp_rank: int | None, id_path: str | None, env=os.environ) -> RankEnv | None:
    """This process's place in the run, or None when it must start the ranks itself."""
    if ENV_RANK in env:
        world = int(env[ENV_WORLD])
        return RankEnv(int(env[ENV_RANK]), world, int(env[ENV_RANK]), world, None, env[ENV_RDZV])
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        if tp_world not in (1, world):
            raise UsageError(f"--tp-world {tp_world} disagrees with torchrun's WORLD_SIZE={world}")
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return RankEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world, "env://")
    if tp_rank is not None:
        if not 0 <= tp_rank < tp_world:
            raise UsageError(f"--tp-rank must be in 0..{tp_world - 1}, got {tp_rank}")
        if not id_path:
            raise UsageError("--tp-rank needs --nccl-id-path FILE, the rendezvous file every rank names")
        return RankEnv(tp_rank, tp_world, tp_rank, tp_world, None, os.path.abspath(id_path))
    if tp_world == 1:
        return RankEnv(0, 1, 0, 1, None)
    return None


def init_distributed(renv: RankEnv, backend: str, timeout_s: float) -> None:
    set_tp(renv.rank, renv.world)
    if renv.world == 1:
        return
    timeout = timedelta(seconds=timeout_s)
    if renv.file_store is not None:
        attempts = int(os.environ.get(ENV_WAIT_ATTEMPTS, DEFAULT_WAIT_ATTEMPTS))
        store = dist.FileStore(renv.file_store, renv.world)
        store.set_timeout(timedelta(seconds=max(1.0, attempts * WAIT_ATTEMPT_SECONDS)))
        dist.init_process_group(backend, store=store, rank=renv.rank, world_size=renv.world, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=renv.init_method, rank=renv.rank, world_size=renv.world, timeout=timeout)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Runs in each child before exec: the kernel kills it if the launcher dies outright."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def spawn_local_ranks(world: int, argv: list[str]) -> int:
    """Start `world` ranks of this same command and wait for all of them. When one fails, stop the
    rest and report the first failure; returns the exit status for the command."""
    rdzv_dir = tempfile.mkdtemp(prefix="pocketllm-rdzv-")
    procs: list[subprocess.Popen] = []
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(world):
            env = dict(os.environ, **{ENV_RANK: str(rank), ENV_WORLD: str(world), ENV_RDZV: os.path.join(rdzv_dir, "store")})
            procs.append(subprocess.Popen([sys.executable, "-m", "pocketllm", *argv], env=env, preexec_fn=_die_with_parent))
        failure = None
        while True:
            codes = [p.poll() for p in procs]
            if stopping["signal"] is not None:
                failure = (None, f"launcher got {signal.Signals(stopping['signal']).name}; stopped every rank", 128 + stopping["signal"])
                break
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    failure = (rank, f"rank {rank} failed ({_describe_exit(code)})", 2 if code == 2 else 1)
                    break
            if failure or all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        if failure is None:
            return 0
        _stop(procs)
        rank, message, status = failure
        if status != 2:
            print(f"pocketllm: error: {message}", file=sys.stderr)
        return status
    finally:
        _stop(procs)
        for s, handler in old.items():
            signal.signal(s, handler)
        shutil.rmtree(rdzv_dir, ignore_errors=True)


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

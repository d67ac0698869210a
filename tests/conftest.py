"""Shared test helpers: run the CLI as a user would (a fresh process, short timeouts), check its
one-line usage errors (from a fresh process, or from a call in this one that must start no rank)
and its generated ids, find a free port, start a run whose processes can all be found again (start,
assert_nothing_left), and copy the tiny checkpoint for a test to break; and --shard, which shares
a run's tests out over processes started side by side."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from pocketllm import cli, compiled, launch
from pocketllm.switches import ALIASES, RENAMED, SETTINGS

REPO = Path(__file__).resolve().parents[1]

# Settings a developer may have exported that would change what a command does (every variable
# pocketllm reads, under either name, and the old names it refuses, but the kernel cache the
# session sets, _use_a_private_cache); every CLI call a test makes, in a subprocess or in this
# process, runs without them.
UNSET_FOR_CLI = tuple(name for name in (*SETTINGS, *ALIASES.values(), *RENAMED) if name != compiled.ENV_CACHE_DIR)
# Those of them the developer's environment held when the session started.
EXPORTED = {name: os.environ[name] for name in UNSET_FOR_CLI if name in os.environ}

# Every CLI run a test starts in a subprocess (run_cli, start) is `python -m pocketllm ARGS` plus one
# check: a process about to start ranks must not have imported torch (a launcher checks the run and
# starts its ranks without it, so they start sooner: docs/tensor-parallel.md), unless it had to: a
# forced kernel to check, or a GPU build of torch with its driver here to ask. One that did stops there, exit status 3,
# with a line saying so. The ranks it starts are `python -m pocketllm` itself.
CLI_ENTRY = """
import os, sys
from pocketllm.commands import ranked
from pocketllm.device_kind import torch_may_see_a_gpu
from pocketllm.switches import forces_kernels
spawn = ranked.spawn_local_ranks
def spawn_without_torch(*args, **kwargs):
    if "torch" in sys.modules and not forces_kernels(os.environ) and not torch_may_see_a_gpu():
        print("test entry: the launcher imported torch before it started its ranks", file=sys.stderr, flush=True)
        sys.exit(3)
    return spawn(*args, **kwargs)
ranked.spawn_local_ranks = spawn_without_torch
from pocketllm.cli import script
script()
"""


# Set beside POCKETLLM_CACHE_DIR to the test session's private cache (a name pocketllm never reads).
SESSION_CACHE = "TESTS_SESSION_KERNEL_CACHE"
# matplotlib's font cache (the sweep's plot) goes there too, not into the user's home.
CACHE_ENV = (compiled.ENV_CACHE_DIR, SESSION_CACHE, "MPLCONFIGDIR")
# (the directory this session made, or None where it inherited one; CACHE_ENV's values before)
_CACHE = pytest.StashKey[tuple[str | None, dict]]()


def _use_a_private_cache() -> tuple[str | None, dict]:
    """Compiled kernels and measured kernel choices go to a cache of this test session's own, not
    the user's: a test must not read a choice some earlier run measured, nor leave one behind. Set
    before collection, since modules ask at import whether a kernel builds. Processes the tests
    start inherit it, test sessions a test starts (the interpreter's, the narrower builds')
    included: they use the cache of the session that started them rather than compile its kernels
    again. The directory made here (None where one was inherited), and the variables before."""
    before = {name: os.environ.get(name) for name in CACHE_ENV}
    if before[SESSION_CACHE] and before[SESSION_CACHE] == before[compiled.ENV_CACHE_DIR]:
        return None, before
    own = tempfile.mkdtemp(prefix="pocketllm-tests-cache-")
    for name in CACHE_ENV:
        os.environ[name] = own
    return own, before


def pytest_addoption(parser):
    parser.addoption(
        "--shard", metavar="K/N", default=None,
        help="run shard K (0-based) of N of the collected tests, the others deselected: N processes given "
        "K = 0..N-1 run each test once between them (tests/triton_on_cpu.py runs the interpreted files so)",
    )


def pytest_configure(config):
    own, _ = config.stash[_CACHE] = _use_a_private_cache()
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton_on_cpu import helpers_without_repatching, scalars_index_as_numpy_allows

        helpers_without_repatching()
        scalars_index_as_numpy_allows()
    if own:
        # The suite's own session (not one a test started): start_ranks' server imports torch
        # while the tests are collected, on the core collection leaves idle.
        import multiprocessing.forkserver

        multiprocessing.forkserver.ensure_running()


def pytest_unconfigure(config):
    own, before = config.stash.get(_CACHE, (None, {}))
    if own:
        shutil.rmtree(own, ignore_errors=True)
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _shard_of(i: int, n: int) -> int:
    """Item i's shard: dealt out 0, 1, .., n-1, then back n-1, .., 0, and again, so that neighbours
    in a parametrization (often alike in cost, or alternating) are spread evenly."""
    r = i % (2 * n)
    return r if r < n else 2 * n - 1 - r


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    k, n = (int(v) for v in spec.split("/"))
    if not 0 <= k < n:
        raise pytest.UsageError(f"--shard {spec}: K must be in 0..N-1")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if _shard_of(i, n) != k])
    items[:] = [item for i, item in enumerate(items) if _shard_of(i, n) == k]


# pytest rewrites each test module's asserts as it imports it and keeps the result beside the
# module's bytecode, except where bytecode is not being written (PYTHONDONTWRITEBYTECODE, as some CI
# images set): there the suite's own pytest processes (the interpreter's shards, the narrower-ISA
# runs) rewrote them all again, and so did every later run (2.3 s of this process's collection on a
# 2-core VM). Written, as cached_bytecode writes pocketllm's; this process's modules, imported
# after this conftest, are the first to be kept.
sys.dont_write_bytecode = False


@pytest.fixture(scope="session", autouse=True)
def cached_bytecode():
    """Where bytecode is not being written (PYTHONDONTWRITEBYTECODE, as some CI images set), every
    process the tests start would compile pocketllm's and the tests' sources again (a tenth of a
    second of a core each, over a hundred processes); compiled once here, into the __pycache__
    directories Python writes by default, they read it instead."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        import compileall

        for folder in (REPO / "pocketllm", REPO / "tests"):
            compileall.compile_dir(folder, quiet=2)


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    for name in UNSET_FOR_CLI:
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(*args, timeout: float = 120, env: dict | None = None, cwd=None, **run_kwargs) -> subprocess.CompletedProcess:
    """`python -m pocketllm ARGS` (through CLI_ENTRY's check); a hang fails the test at `timeout`
    seconds. Other keywords go to subprocess.run (preexec_fn, say)."""
    cmd = [sys.executable, "-c", CLI_ENTRY, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or cli_env(), cwd=cwd, **run_kwargs)


def result_fields(stdout: str) -> dict[str, str]:
    """key=value pairs of the last line that has them."""
    for line in reversed(stdout.strip().splitlines()):
        if "=" in line:
            return dict(part.split("=", 1) for part in line.split())
    return {}


def usage_line(rc: int, stderr: str, fragments) -> str:
    """A usage error as a user sees it: exit code 2 and exactly one line on stderr, `pocketllm:
    error: ...` (`pocketllm COMMAND: error: ...` when a command's own parser refuses a flag value),
    holding every fragment; returns the line. (One line rules out a traceback.)"""
    assert rc == 2, (rc, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"pocketllm( [\w-]+)?: error: ", lines[0]), stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def assert_usage_error(r: subprocess.CompletedProcess, *fragments: str) -> str:
    """usage_line of a finished `pocketllm` process."""
    return usage_line(r.returncode, r.stderr, fragments)


@pytest.fixture
def no_ranks(monkeypatch):
    """For a CLI call in this process: starting a rank fails the test, which proves a usage error
    starts none, and the environment lacks what run_cli removes from a subprocess's. Popen is
    patched on the subprocess module itself, so such a test cannot run_cli either; fixtures of a
    wider scope (tiny_ckpt) are set up before this one and are unaffected."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started for a bad input")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)
    for name in UNSET_FOR_CLI:
        monkeypatch.delenv(name, raising=False)


def main_in_process(*argv) -> int:
    """`pocketllm ARGS` called in this process (no interpreter or torch start); its exit code. What
    main() may change in this process is put back so later tests do not inherit it: a single-rank
    run gives itself every core (device.setup_device), and logging.basicConfig adds a root handler
    holding this test's captured stderr when pytest's logging plugin is off. A setting the
    developer exported is left out of the call, as run_cli leaves it out of a subprocess's; one
    the test set itself stays."""
    threads = torch.get_num_threads()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in EXPORTED.items():
                if os.environ.get(name) == value:
                    mp.delenv(name)
            return cli.main([str(a) for a in argv])
    except SystemExit as exc:
        # argparse refuses a flag by exiting from inside main().
        return exc.code
    finally:
        torch.set_num_threads(threads)
        root.handlers[:] = handlers
        root.setLevel(level)


def usage_error_in_process(capsys, *argv, expect: str | tuple[str, ...] = ()) -> str:
    """usage_line of main_in_process(ARGS), holding every `expect` fragment. An exception escaping
    main() fails the test, as a traceback would fail assert_usage_error. Use with no_ranks."""
    rc = main_in_process(*argv)
    return usage_line(rc, capsys.readouterr().err, (expect,) if isinstance(expect, str) else expect)


def generated_ids(stdout: str) -> list[int]:
    """The token ids of the one `generated_ids=` line a generate run prints."""
    lines = [line for line in stdout.splitlines() if line.startswith("generated_ids=")]
    assert len(lines) == 1, stdout
    return [int(t) for t in lines[0].split("=", 1)[1].split(",") if t]


# Ranks a test starts in-process (start_ranks) are forked from one server process per session that
# has imported torch, rather than each importing it (about a second of a core apiece).
multiprocessing.set_forkserver_preload(["torch"])


def start_ranks(fn, nprocs: int, *args) -> None:
    """fn(rank, *args) in `nprocs` new processes, joined; any failure fails the test. They are
    forked from multiprocessing's forkserver, which imported torch once for the session, and each
    runs with this process's environment as it is now (the server's own is as it was when it
    started): torch's threads and settings are made in the rank, none in the server, so a fork
    from it is what a fresh start would be. fn must be a module's own function, as for spawn."""
    import torch.multiprocessing as mp

    outputs = (_Fd(1), _Fd(2))
    mp.start_processes(_in_env, args=(fn, dict(os.environ), outputs, *args), nprocs=nprocs, join=True, start_method="forkserver")


class _Fd:
    """One of this process's fds, duplicated into the rank as multiprocessing passes a pipe's:
    the rank writes where the test's output goes now (pytest's capture), not where the server's
    went when it started."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detached, (reduction.DupFd(self.fd),))


def _detached(dup) -> int:
    return dup.detach()


def _in_env(rank: int, fn, env: dict, outputs: tuple, *args) -> None:
    for target, fd in zip((1, 2), outputs):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    # multiprocessing's default, as in a rank the CLI starts: under the forkserver's own a lock made
    # here (tqdm makes one) would be a named semaphore, left to the resource tracker to clean up
    # (and warn about) when the rank ends with end_process.
    multiprocessing.set_start_method("fork", force=True)
    fn(rank, *args)


def end_process(code: int = 0) -> None:
    """End a process a test started (a spawned rank, a script) once its work and checks are done,
    without the interpreter's teardown: torch's is most of such a process's exit time, and
    pocketllm registers nothing to run at exit (no atexit handler or finalizer) and leaves no
    thread to wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shm_segments() -> set[str]:
    """The shared-memory all-reduce's segments in /dev/shm (each run unlinks its own at setup)."""
    from pocketllm.distributed.shm import segment

    return {name for name in os.listdir(segment.SHM_DIR) if name.startswith(segment.PREFIX)}


def stale_segments() -> set[str]:
    """shm_segments whose creating rank 0 is gone: what a run that has ended may have left behind.
    (A run still going beside it holds its own segment in /dev/shm for the moment between
    creating it and every rank mapping it; that one is not stale.)"""
    from pocketllm.distributed.shm import segment

    stale = set()
    for name in shm_segments():
        m = segment._NAME.fullmatch(name)
        try:
            if m is not None:
                os.kill(int(m.group(1)), 0)
                continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process has the pid: its creator is alive
        stale.add(name)
    return stale


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a rendezvous a test sets up itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every run started with start() is tagged through its environment, so a test finds all of its
# processes (even ones the launcher lost) by scanning /proc.
TAG = "PYTEST_RUN_TAG"


@dataclass
class Run:
    """A started run: its stderr lines as they come (with their arrival times), and `ended`, when
    its launcher exited, recorded by a thread as it happens, so that a run a test waits for late
    (one started beside other work) still shows its own exit time."""

    proc: subprocess.Popen
    tag: str
    tmpdir: Path
    started: float
    lines: list = field(default_factory=list)  # (arrival time, stderr line)
    stdout: str = ""
    ended: float | None = None
    _out: list = field(default_factory=list, repr=False)  # stdout, once read to its end

    def line_time(self, fragment: str, timeout: float = 60) -> float:
        """When a stderr line containing fragment arrived (waits for it, or for the run's end)."""
        deadline = time.monotonic() + timeout
        while True:
            # Looked at before the lines: once the reader is done every line it read is there.
            done = not self._reader.is_alive() or (self.ended is not None and time.monotonic() - self.ended > 5)
            for t, line in list(self.lines):
                if fragment in line:
                    return t
            if done or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        raise AssertionError(f"no stderr line with {fragment!r}:\n{self.stderr}")

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    @property
    def last_line(self) -> str:
        return self.lines[-1][1].strip() if self.lines else ""

    def wait(self, timeout: float = 90) -> int:
        """The launcher's exit status, once it has exited (a hang past `timeout` seconds kills the
        run and fails the test); its stdout is then in `stdout`. Safe to call again."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            kill_tagged(self.tag)
            raise AssertionError(f"the run hung past {timeout} s:\n{self.stderr}") from None
        self._watcher.join(timeout=5)
        if self.ended is None:
            self.ended = time.monotonic()
        self._reader.join(timeout=5)
        self._out_reader.join(timeout=5)
        self.stdout = "".join(self._out)
        return self.proc.returncode


def start(*args, tmp_path: Path, env: dict | None = None) -> Run:
    """`python -m pocketllm ARGS` (through CLI_ENTRY's check) with its stderr read line by line as
    it comes, its stdout read as it comes, and its exit time taken as it exits."""
    tag = uuid.uuid4().hex
    tmpdir = tmp_path / f"tmp-{tag[:8]}"
    tmpdir.mkdir()
    full_env = cli_env(**{TAG: tag, "TMPDIR": str(tmpdir)})
    full_env.update(env or {})
    cmd = [sys.executable, "-c", CLI_ENTRY, *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
    run = Run(proc, tag, tmpdir, time.monotonic())

    def read():
        for line in proc.stderr:
            run.lines.append((time.monotonic(), line))

    def read_out():
        run._out.append(proc.stdout.read())

    def watch():
        # Waits for the exit without reaping it (WNOWAIT): the Popen still reaps its own child,
        # so poll() and wait() on it behave as without this thread.
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # reaped by a wait() meanwhile: it returned at the exit too
        run.ended = time.monotonic()

    run._reader = threading.Thread(target=read, daemon=True)
    run._out_reader = threading.Thread(target=read_out, daemon=True)
    run._watcher = threading.Thread(target=watch, daemon=True)
    for thread in (run._reader, run._out_reader, run._watcher):
        thread.start()
    return run


def tagged(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries this run's tag."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry))
    return found


def kill_tagged(tag: str) -> None:
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_nothing_left(run: Run, within: float = 0.0) -> None:
    deadline = time.monotonic() + within
    while (left := tagged(run.tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        kill_tagged(run.tag)
    assert not left, f"processes of the run left behind: {left}"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny preset written as an HF checkpoint by `pocketllm make-checkpoint`, in this process."""
    out = tmp_path_factory.mktemp("tiny_ckpt")
    assert main_in_process("make-checkpoint", "--preset", "tiny", "--out", out) == 0
    return out


def metaspace_tokenizer(size: int):
    """A SentencePiece-style tokenizer (Metaspace, as Llama's and Mistral's): id i is the word
    "▁w{i}", so every id decodes to " w{i}" except as a sequence's first token, whose leading
    space the decoder drops."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"\u2581w{i}": i for i in range(size)}, unk_token="\u2581w0"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return tok


def words(ids) -> str:
    """What ids of metaspace_tokenizer add after a prompt."""
    return "".join(f" w{i}" for i in ids)


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint, for a test to break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def tiny_engine(dtype: torch.dtype = torch.float32, invariant: bool = True, cfg=None):
    """The tiny preset's engine (or `cfg`'s) at TP=1 in this process, with its seeded random
    weights; batch-invariant unless asked (POCKETLLM_BATCH_INVARIANT, read when it is made)."""
    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.ops.registry import ENV_INVARIANT
    from pocketllm.presets import get_preset

    set_tp(0, 1)
    cfg = cfg or get_preset("tiny")
    saved = os.environ.get(ENV_INVARIANT)
    os.environ[ENV_INVARIANT] = "1" if invariant else "0"
    try:
        return Engine(cfg, RandomWeights(cfg, dtype=dtype), dtype, torch.device("cpu"), RulePolicy())
    finally:
        if saved is None:
            os.environ.pop(ENV_INVARIANT)
        else:
            os.environ[ENV_INVARIANT] = saved


def device_engine(ops, dtype: torch.dtype = torch.float32, shape=None, max_len: int = 200, cfg=None, invariant: bool = True):
    """tiny_engine(dtype, invariant, cfg) in a device's pass shape on this CPU (DEVICE_PASS unless
    `shape`), 4 slots of max_len reserved, with `ops` (an ops/device DeviceOps) wherever the model
    takes a device's ops. The step backend is the caller's to set."""
    from pocketllm.layers.context import DEVICE_PASS

    engine = tiny_engine(dtype, invariant, cfg)
    engine.pass_shape = shape or DEVICE_PASS
    engine.reserve_slots(4, max_len)
    use_device_ops(engine.model, ops)
    return engine


def use_device_ops(model, ops, set_attr=setattr) -> None:
    """Put `ops` (an ops/device DeviceOps) wherever the model's modules take a device's ops: every
    module reaches them through its decode_ops. `set_attr`: monkeypatch.setattr to undo it after
    the test."""
    for m in model.modules():
        if hasattr(m, "decode_ops"):
            set_attr(m, "decode_ops", replace(m.decode_ops, device=ops))


def feed(engine, ids, start: int = 0, slot: int = 0, all_logits: bool = False) -> torch.Tensor:
    """One sequence's rows through the engine's pass, in `slot` from position `start` (0 begins
    a new sequence there): the fp32 logits of the last row [V], or of every row [T, V]."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    out = engine.run_packed([(slot, start, ids)], all_logits=all_logits)
    return out if all_logits else out[0]


def follow_in_process(monkeypatch, leader, follower, max_running: int, max_ops: int = 64, prefill_budget: int | None = None) -> list:
    """Rank 0's scheduler plans (for a Scheduler of these sizes made after this call), as the
    other ranks get them, run on `follower` (an engine of this process, reserved as `leader`,
    rank 0's, is): after a step's operations and before its pass, its blocks (free, held per
    slot, holders) and prefix cache entries must be rank 0's. Plans carry `max_ops` operations.
    Returns the list the operations seen are added to."""
    from pocketllm.distributed.state import TPState
    from pocketllm.engine import budgets, pass_plan, scheduler

    prefill_budget = prefill_budget or budgets.DEFAULT_PREFILL_BUDGET
    monkeypatch.setattr(pass_plan, "MAX_OPS", max_ops)
    received = pass_plan.pass_plan_for(leader, max_running, prefill_budget)
    seen = []

    def broadcast(buf, src=0, idle=False):
        received.buf.copy_(buf)
        ops, spans, all_logits = received.decode()
        pass_plan.apply(follower, ops)
        seen.extend(ops)
        if not spans:
            return  # more of this step's operations follow in the next plan
        assert follower.slots.blocks.free == leader.slots.blocks.free and follower.slots.blocks.holders == leader.slots.blocks.holders
        assert [t.held for t in follower.slots.blocks.tables] == [t.held for t in leader.slots.blocks.tables]
        assert {k: (c.length, c.blocks) for k, c in follower.slots.cached.items()} == {k: (c.length, c.blocks) for k, c in leader.slots.cached.items()}
        pass_plan.run_pass_plan(follower, [], spans, all_logits)

    monkeypatch.setattr(scheduler, "tp", lambda: TPState(0, 2))
    monkeypatch.setattr(pass_plan, "broadcast_", broadcast)
    return seen


class ServePair:
    """serve's two sides in this process, linked by a socket pair as serve links its two
    processes: the engine driver stepping `scheduler` in a thread, and the HTTP side's client."""

    def __init__(self, scheduler, on_end=None):
        import socket

        from pocketllm.serving.engine_client import EngineClient
        from pocketllm.serving.engine_driver import EngineDriver
        from pocketllm.serving.metrics import Metrics

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.scheduler = scheduler
        self.driver = EngineDriver(scheduler, ours)
        self.client = EngineClient(theirs, Metrics(), scheduler.vocab, scheduler.max_len)
        if on_end is not None:
            self.client.on_end = on_end
        self.metrics = self.client.metrics
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.driver.run()
        except BaseException as exc:
            self.failure = exc

    def start(self) -> None:
        self.client.start()
        self._thread.start()

    def submit(self, *args):
        return self.client.submit(*args)

    def begin_shutdown(self) -> None:
        self.client.request_stop()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

"""How ranks find each other, bounded and checked, before torch.distributed takes over.

- Started by the local launcher: a FileStore in a fresh private directory (mode 0700) that the
  launcher made for this run and removes afterwards.
- Started by hand with `--rendezvous-file FILE`: rank 0 creates FILE exclusively and writes a run
  nonce into it; the FileStore lives next to it in FILE.store. The other ranks wait (bounded by
  POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS, or the seed's POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS) for FILE, register their rank in the store once, and wait
  for rank 0 to answer. A FILE left by an earlier run is refused with the command that clears it.
  A rank that stops before it joins (a refused flag) says so in FILE, and a rank 0 waiting there
  stops at once with its line (tell_rank0).
- Under torchrun (env://): torch's TCPStore on MASTER_ADDR:MASTER_PORT; a port already in use is
  a one-line error.

torch.distributed is imported by the functions that join or leave a group: the launcher makes its
private directory here and never imports torch (pocketllm/launch.py).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta

from pocketllm.errors import UsageError
from pocketllm.processes import alive
from pocketllm.switches import env_setting

ENV_WAIT_ATTEMPTS = "POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS"
# One wait attempt of the hand-started rendezvous (the seed's C++ engine counted waits so).
WAIT_ATTEMPT_SECONDS = 0.01
DEFAULT_WAIT_ATTEMPTS = 12_000
MAGIC = "pocketllm-rendezvous 1"
END = "end"
REFUSED = "refused"
FAILED = "failed"  # appended by a rank that stopped before it joined: "failed=RANK ITS ERROR"
# How long a rank refused at start waits for its rank 0's FILE, to tell it (tell_rank0), or a
# rank 0 refused at start keeps a FILE saying so for the others (tell_the_others).
TELL_WAIT_SECONDS = 10.0
SEEN = "seen"  # appended by a rank that read rank 0's refusal: "seen=RANK"

# Files this process must remove when the run ends (rank 0 of a hand-started run owns them).
_owned: list[str] = []
# Whether this process came to the rendezvous: a refusal after that finds FILE there or gone for
# good (its rank 0 ended too), never yet to be made (tell_rank0).
_came = False


class RendezvousError(UsageError):
    """The ranks cannot meet as asked: a stale or unwritable rendezvous file, a busy port."""


PRIVATE_PREFIX = "pocketllm-rdzv-"
_PRIVATE_NAME = re.compile(re.escape(PRIVATE_PREFIX) + r"(\d+)-[\w]+")


def private_dir(root: str | None = None) -> str:
    """A fresh directory only this user can enter (mkdtemp makes it 0700), for one run, named after
    the launcher's pid. A launcher killed outright (SIGKILL) cannot remove its own; the next launch
    removes every one whose launcher is gone."""
    root = root or tempfile.gettempdir()
    remove_stale_private_dirs(root)
    return tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=root)


def remove_stale_private_dirs(root: str) -> None:
    """Remove this user's private rendezvous directories under root whose launcher has exited."""
    for entry in os.scandir(root):
        m = _PRIVATE_NAME.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        # Another user's process with the pid means this user's launcher is gone.
        if not alive(int(m.group(1)), others_count=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def wait_seconds(env=os.environ) -> float:
    used, raw = env_setting(env, ENV_WAIT_ATTEMPTS)
    try:
        attempts = int(raw) if raw.strip() else DEFAULT_WAIT_ATTEMPTS
    except ValueError:
        raise UsageError(f"{used} must be a positive integer, got {raw!r}") from None
    if attempts < 1:
        raise UsageError(f"{used} must be a positive integer, got {attempts}")
    return attempts * WAIT_ATTEMPT_SECONDS


def join_group(backend: str, rank: int, world: int, timeout_s: float, store_path: str | None, id_path: str | None) -> None:
    # A hand-started rank takes SIGTERM as Ctrl-C for its whole run (rank.run_rank), this wait
    # included: either unwinds through leave_group, which removes rank 0's --rendezvous-file.
    try:
        _join_group(backend, rank, world, timedelta(seconds=timeout_s), store_path, id_path)
    except BaseException:
        leave_group(failed=True)
        raise


# NCCL and HCCL carry only device tensors, but the commands also reduce a few host numbers (a max
# of timings over ranks, every rank's RSS): a gloo backend serves the CPU tensors in the same group.
_DEVICE_OF_BACKEND = {"nccl": "cuda", "hccl": "npu"}


def backend_spec(backend: str) -> str:
    """The init_process_group backend string: a device backend gets gloo for CPU tensors beside it."""
    device = _DEVICE_OF_BACKEND.get(backend)
    return backend if device is None else f"cpu:gloo,{device}:{backend}"


@contextmanager
def stdout_silenced():
    """This process's file descriptor 1 sent to /dev/null for the block, what Python had buffered
    for it written first. The gloo of torch 2.10 (the one torch_npu pins) writes "[Gloo] Rank R is
    connected to N peer ranks ..." to stdout from C++ as each rank joins a group, where generate
    prints its results; it says nothing an error would not. A closed fd 1 is left as it is."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _join_group(backend: str, rank: int, world: int, timeout: timedelta, store_path: str | None, id_path: str | None) -> None:
    import torch.distributed as dist

    backend = backend_spec(backend)
    if id_path is not None:
        store = _file_rendezvous(id_path, rank, world, wait_seconds())
        store.set_timeout(timeout)
    elif store_path is not None:
        store = dist.FileStore(store_path, world)
        store.set_timeout(timeout)
    else:
        try:
            with stdout_silenced():
                dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        except dist.DistNetworkError as exc:
            if "EADDRINUSE" in str(exc):
                port = os.environ.get("MASTER_PORT", "?")
                raise RendezvousError(
                    f"MASTER_PORT {port} is already in use on {socket.gethostname()}; rank 0 listens there for the "
                    f"rendezvous, so give every rank a free port (torchrun --master-port PORT)"
                ) from None
            raise
        return
    with stdout_silenced():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


# Backends whose destroy_process_group waits for the collectives in flight to finish (torch's NCCL
# since 2.6; HCCL's after it).
_FLUSHING = ("nccl", "hccl")


def leave_group(failed: bool = False) -> None:
    """Leave the process group (and remove a rendezvous file this rank made). failed: the rank is
    ending on a failure, when a collective it started may never be matched by its peers."""
    import torch.distributed as dist

    if dist.is_initialized():
        # torch's private abort (2.5 on; before it destroy did not wait for collectives in flight).
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if failed and abort is not None and any(b in str(dist.get_backend()) for b in _FLUSHING):
            # Destroying would wait for that collective until the watchdog's timeout (minutes);
            # aborted, the rank ends at once, and its peers see it leave as on gloo.
            abort()
        else:
            dist.destroy_process_group()
    while _owned:
        try:
            os.unlink(_owned.pop())
        except FileNotFoundError:
            pass


def _clear_command(path: str) -> str:
    return f"rm -f {path} {path}.store"


def _read(path: str) -> dict | None:
    """FILE's fields once rank 0 has finished writing it; None while absent or half written."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    first, newline, _ = text.partition("\n")
    if not newline:
        # Half written, or no rendezvous file at all (one line without its newline, say).
        return None if MAGIC.startswith(text) else {"foreign": "1"}
    if first != MAGIC:
        # A file of another tool is never joined.
        return {"foreign": "1"}
    lines = text.splitlines()
    if END not in lines:
        return None
    # A later refusal is appended after the end marker and must not hide the first nonce.
    fields = {}
    for key, _, value in (line.partition("=") for line in lines[1:] if "=" in line):
        fields.setdefault(key, value)
    return fields


def _stale_message(path: str, fields: dict | None) -> str:
    clear = f"clear it with `{_clear_command(path)}` and start every rank again"
    if fields and "foreign" in fields:
        # Another tool's file, or the user's own (a token-ids file given by mistake): never
        # written to, and not to be removed on our word.
        return f"--rendezvous-file {path} exists and is not a pocketllm rendezvous file; give a path that does not exist"
    if not fields or "nonce" not in fields:
        return f"--rendezvous-file {path} exists and is not a whole pocketllm rendezvous file; pick another path or {clear}"
    origin = f"run {fields['nonce']} (rank 0 pid {fields.get('pid', '?')} on {fields.get('host', '?')}, started {fields.get('started', '?')})"
    if fields.get("host") == socket.gethostname() and _alive(fields.get("pid", "")):
        return f"--rendezvous-file {path} is in use by {origin}, which is still running; give this run another path"
    return f"--rendezvous-file {path} is left from an earlier {origin}; {clear}"


def _alive(pid: str) -> bool:
    """A pid as FILE records it (text; absent in a foreign file)."""
    return pid.isdigit() and alive(int(pid))


def _check_dir(path: str) -> None:
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise RendezvousError(f"--rendezvous-file {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RendezvousError(f"--rendezvous-file {path}: directory {parent} is not writable by this user")


def begin_command() -> None:
    """A command begins in this process (the CLI's main, which tests call again in one process):
    it has not come to a rendezvous yet."""
    global _came
    _came = False


def _file_rendezvous(path: str, rank: int, world: int, wait_s: float):
    global _came
    _came = True
    _check_dir(path)
    if rank == 0:
        return _create(path, world, wait_s)
    return _join(path, rank, world, wait_s)


def _create(path: str, world: int, wait_s: float):
    import torch.distributed as dist

    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        fields = _read(path)
        if fields and "nonce" in fields:
            _mark_refused(path)
        raise RendezvousError(_stale_message(path, fields)) from None
    except OSError as exc:
        raise RendezvousError(f"--rendezvous-file {path}: cannot create it, directory {os.path.dirname(path) or '.'} is not writable ({exc.strerror})") from None
    _owned.extend([path + ".store", path])
    try:
        # Holding FILE exclusively means no live run uses FILE.store: a leftover one is garbage.
        if os.path.exists(path + ".store"):
            os.unlink(path + ".store")
        store = dist.FileStore(path + ".store", world)
        fields = {
            "nonce": secrets.token_hex(8),
            "world": str(world),
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        # One write with the end marker last, so a reader never acts on half a file.
        body = "\n".join([MAGIC, *(f"{k}={v}" for k, v in fields.items()), END, ""])
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    joined = [f"join/{r}" for r in range(1, world)]
    deadline = time.monotonic() + wait_s
    while not store.check(joined):
        failed = (_read(path) or {}).get(FAILED)
        if failed:
            rank, _, why = failed.partition(" ")
            raise RendezvousError(f"rank {rank} stopped before it joined at --rendezvous-file {path}: {why}")
        if time.monotonic() > deadline:
            missing = [str(r) for r in range(1, world) if not store.check([f"join/{r}"])]
            raise RendezvousError(
                f"rank(s) {', '.join(missing)} never joined at --rendezvous-file {path} within {wait_s:g} s "
                f"({ENV_WAIT_ATTEMPTS} x {WAIT_ATTEMPT_SECONDS} s); start every rank with the same path and --tp-world {world}"
            )
        time.sleep(WAIT_ATTEMPT_SECONDS)
    store.set("go", fields["nonce"])
    return store


def _mark_refused(path: str) -> None:
    """Tell ranks waiting on a stale FILE that no rank 0 will answer there, so they stop now."""
    _append(path, f"{REFUSED}={os.getpid()}")


def _tell_bound() -> float:
    """How long a rank refused at start waits to tell the others (tell_rank0, tell_the_others):
    none once it came to the rendezvous (FILE is there, or gone for good)."""
    if _came:
        return 0.0
    try:
        return min(TELL_WAIT_SECONDS, wait_seconds())
    except UsageError:
        return 0.0  # the bound's own variable is what was refused


def tell_rank0(path: str, rank: int, message: str) -> None:
    """A hand-started rank other than 0 that stops before it joins (its command refused) says why in
    FILE, where a rank 0 waiting for it looks, so that rank 0 stops now with this line rather than
    at the end of its wait. Only a whole pocketllm rendezvous file is written to. Refused before it
    came to the rendezvous, it waits for a FILE not made yet, up to TELL_WAIT_SECONDS (or the
    rendezvous bound, if shorter): ranks started together (a loop, a script) refuse a flag before
    their rank 0 has made it. A rank 0 that comes later than that waits out its bound."""
    deadline = time.monotonic() + _tell_bound()
    while True:
        fields = _read(path)
        if fields and "nonce" in fields:
            _append(path, f"{FAILED}={rank} {' '.join(message.split())}")
            return
        if (fields and "foreign" in fields) or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def tell_the_others(path: str, world: int | None, message: str) -> None:
    """A hand-started rank 0 refused at its start (before it came to the rendezvous) makes FILE
    saying so, for the other ranks started with it, which would otherwise wait out their bound for
    a FILE that never comes; it keeps FILE until every other rank of `world` has read it (or
    TELL_WAIT_SECONDS, or the bound, have passed), then removes it. A FILE already there (another
    run's, or left) is not touched."""
    bound = _tell_bound()
    if bound <= 0:
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return
    try:
        body = "\n".join([MAGIC, f"{FAILED}=0 {' '.join(message.split())}", f"pid={os.getpid()}", END, ""])
        os.write(fd, body.encode())
    finally:
        os.close(fd)
    deadline = time.monotonic() + bound
    try:
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    seen = sum(1 for line in f if line.startswith(SEEN + "="))
            except OSError:
                return
            if world is not None and seen >= world - 1:
                return
            time.sleep(0.05)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _append(path: str, line: str) -> None:
    """Add a line to FILE as it is: never make it. FILE read a moment ago may be gone since (its
    rank 0 ended and removed it); a FILE made here would hold this line alone, a file no run
    removes, that the next run refuses as not pocketllm's."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _join(path: str, rank: int, world: int, wait_s: float):
    import torch.distributed as dist

    deadline = time.monotonic() + wait_s
    fields = _read(path)
    while fields is None:
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"no rank 0 created --rendezvous-file {path} within {wait_s:g} s ({ENV_WAIT_ATTEMPTS} x {WAIT_ATTEMPT_SECONDS} s); "
                f"start rank 0 with the same path"
            )
        time.sleep(WAIT_ATTEMPT_SECONDS)
        fields = _read(path)
    if "foreign" in fields or REFUSED in fields:
        raise RendezvousError(_stale_message(path, fields))
    if "nonce" not in fields and fields.get(FAILED, "").startswith("0 ") and _alive(fields.get("pid", "")):
        # A rank 0 refused at its start, keeping FILE a moment to say so (tell_the_others).
        _append(path, f"{SEEN}={rank}")
        raise RendezvousError(f"rank 0 stopped before the rendezvous at --rendezvous-file {path}: {fields[FAILED][2:]}")
    if fields.get("world") != str(world):
        raise RendezvousError(f"--rendezvous-file {path} belongs to a run of --tp-world {fields.get('world')}, this rank has --tp-world {world}")
    store = dist.FileStore(path + ".store", world)
    # Each rank registers once per run: a second registration means FILE is from a finished or
    # crashed run whose rank already came (or two processes claim the same rank).
    if store.add(f"join/{rank}", 1) > 1:
        raise RendezvousError(_stale_message(path, fields) + f" (or two processes were started as rank {rank})")
    while not store.check(["go"]):
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank 0 of run {fields['nonce']} never answered at --rendezvous-file {path} within {wait_s:g} s: "
                f"it died, or the file is left from an earlier run; clear it with `{_clear_command(path)}` and start every rank again"
            )
        now = _read(path)
        if now is None:
            raise RendezvousError(f"rank 0 of run {fields['nonce']} gave up and removed --rendezvous-file {path}; start every rank again")
        if REFUSED in now:
            raise RendezvousError(_stale_message(path, fields))
        time.sleep(WAIT_ATTEMPT_SECONDS)
    return store

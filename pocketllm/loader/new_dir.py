"""A checkpoint directory written whole or not at all: the commands that write one (make-checkpoint,
quantize) write into a hidden directory beside --out and rename it into place once everything is
written, so an interrupted or failed run leaves no half-written checkpoint where a complete one is
expected, and never mixes its files with what a directory held before."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import sys
from pathlib import Path

from pocketllm.errors import UsageError
from pocketllm.interrupts import sigterm_interrupts
from pocketllm.processes import alive


def check_new_dir(out: str) -> Path:
    """`out` as a path a command may write a checkpoint to: new, or an empty directory. An
    existing checkpoint (or anything else) there is refused before any work starts."""
    if not out:
        raise UsageError("--out is empty: give the directory to write")
    path = Path(out)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise UsageError(f"--out {path}: exists and is not a directory")
        if any(path.iterdir()):
            raise UsageError(f"--out {path}: is not empty; give a new or empty directory (nothing was written)")
        return path
    # A new directory is made with its parents: the nearest that exists must be a directory.
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--out {path}: {parent} is not a directory")
            break
    return path


@contextlib.contextmanager
def written_whole(out: Path):
    """Yields a hidden directory beside `out` (checked by check_new_dir) to write into; on leaving
    without an error it becomes `out`, on any error or interruption it is removed. SIGTERM is
    taken as an interruption while it is open (interrupts.py), so `kill` cleans up too."""
    parent = out.absolute().parent
    # A plain mkdir (not mkdtemp's private 0700): the checkpoint gets the mode any directory would.
    # Named after this host and process, so that the next run can tell one whose writer was
    # killed outright (SIGKILL, a crash: no cleanup ran) and remove it.
    work = parent / f".{out.name}.partial-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _remove_left_by_dead_writers(parent, out.name)
        work.mkdir()
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create ({exc.strerror})") from None
    try:
        with sigterm_interrupts():
            yield work
            if out.is_dir() and not out.is_symlink():
                out.rmdir()  # empty, as check_new_dir found it; not empty now: OSError, nothing lost
            os.rename(work, out)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise UsageError(f"--out {out}: cannot write ({exc.strerror or exc}); nothing was left there") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def _remove_left_by_dead_writers(parent: Path, name: str) -> None:
    """The hidden directories an earlier writer of `name` on this host left when it was killed
    before it could remove them (its process is gone), removed with a note."""
    own = re.compile(rf"\.{re.escape(name)}\.partial-{re.escape(_HOST)}-(\d+)-[0-9a-f]{{8}}")
    for entry in parent.iterdir():
        m = own.fullmatch(entry.name)
        if m is None or not entry.is_dir() or entry.is_symlink() or alive(int(m.group(1))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        print(f"note: removed {entry}, left by an earlier run writing {name} that was killed", file=sys.stderr, flush=True)


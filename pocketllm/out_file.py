"""Writing a file a user named for a command's results (--json, --out, --logits-out), so that
nothing is lost on the way:

- a regular file (or a new name) is written beside itself under a hidden name and renamed over
  the name at the end: a full disk or a failed write leaves the file that was there as it was, and
  no half-written one; a symbolic link stays a link, its target is what gets written;
- anything else the name already is (/dev/null, /dev/stdout, a FIFO) is written into, never
  replaced by a file;
- a write that fails is one line naming the flag and why, not a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable

from pocketllm.errors import UsageError


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_special(path: str) -> bool:
    """Whether `path` (links followed) already is something other than a regular file or a
    directory: a device, a FIFO, a socket."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def write_out(path: str, flag: str, write: Callable[[str], None]) -> None:
    """write(p) writes the results to the file p; they end at `path`, as above."""
    if is_special(path):
        _write_into(path, flag, write)
        return
    real = os.path.realpath(path)
    directory, name = os.path.split(real)
    try:
        mode = stat.S_IMODE(os.stat(real).st_mode)
    except OSError:
        mode = 0o666 & ~umask()  # what open() gives a new file
    work = None
    try:
        fd, work = tempfile.mkstemp(prefix=f".{name}.partial-", dir=directory)
        os.close(fd)
        write(work)
        os.chmod(work, mode)
        os.replace(work, real)
    except OSError as exc:
        _remove(work)
        was = "the file there is as it was" if os.path.exists(real) else "nothing was left there"
        raise UsageError(f"{flag} {path}: cannot write ({_why(exc)}); {was}") from None
    except BaseException:
        _remove(work)
        raise


def _write_into(path: str, flag: str, write: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory(prefix="pocketllm-out-") as tmp:
        work = os.path.join(tmp, "out")
        try:
            write(work)
            with open(work, "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except OSError as exc:
            raise UsageError(f"{flag} {path}: cannot write ({_why(exc)})") from None


def _why(exc: BaseException) -> str:
    # safetensors reports an I/O error as its own exception; its message carries the OS's words.
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


def _remove(path: str | None) -> None:
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_json(path: str, flag: str, doc) -> None:
    def write(p: str) -> None:
        with open(p, "w") as f:
            json.dump(doc, f, indent=2)

    write_out(path, flag, write)

"""The per-machine file where trusted kernel choices are kept (under compiled.cache_dir()), so the
next load on the same machine only reads them and checks them. An entry's key names what it
depends on (CPU, torch version, compiled sources, kind, weight format, threads, shape), so
another machine or version measures its own.

Writers hold an exclusive lock on a file beside it, read what is there, merge their entries in,
write a temporary file and rename it over the old one: two processes loading at once keep both
their entries, and a reader (which takes no lock) sees either the old file or the new one, never a
torn one.
"""

from __future__ import annotations

import contextlib
import json
import os

from pocketllm import compiled

FILE = "kernels.json"


def path(name: str = FILE) -> str:
    return str(compiled.cache_dir() / name)


def read(name: str = FILE) -> dict:
    """Every entry in the file; {} if there is none or it cannot be read as a JSON object."""
    try:
        with open(path(name)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked(target: str):
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(f"{target}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write(entries: dict, name: str = FILE) -> bool:
    """Merge `entries` into the file; False if it could not be written (a read-only home only
    means measuring again next time)."""
    target = path(name)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with _locked(target):
            data = read(name)
            data.update(entries)
            tmp = f"{target}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, target)
        return True
    except OSError:
        return False

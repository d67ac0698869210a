"""Compiling the shared-memory all-reduce's C helper on first use and loading it with ctypes.

The library is built with the system C compiler (no ninja, no torch extension machinery) into a
per-user cache directory, under a name keyed by a hash of the source, the compiler command and the
CPU's feature flags (it is built with -march=native, so a cache shared between machines must not
hand one machine another's build). A build takes a fraction of a second; later runs load it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("allreduce.c")
ENV_CC = "CC"
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")


class BuildError(Exception):
    """No helper library: no compiler, a failed compile, or an unsafe cache directory. The message
    is one line, for the note that says the run uses gloo instead."""


def compiler() -> str | None:
    for name in (os.environ.get(ENV_CC), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pocketllm" / "shm"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(cc: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), " ".join(FLAGS).encode(), platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"libpocketllm_shm-{key.hexdigest()[:16]}.so"


def _private_dir(path: Path) -> None:
    """Create the cache directory 0700 if need be, and refuse one another user could write to: a
    library loaded from it runs in this process."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BuildError(f"the helper cache {path} is not this user's private directory")


def build() -> Path:
    """The helper library's path, compiled now if this source has not been built here before."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc, gcc or clang; or $CC) to build the shared-memory all-reduce")
    lib = library_path(cc)
    _private_dir(lib.parent)
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=lib.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            first = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[0]
            raise BuildError(f"{cc} could not build the shared-memory all-reduce: {first}")
        # Atomic: a rank that loads it sees a whole library or none.
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load(path: Path | str) -> ctypes.CDLL:
    """The helper with every entry point's signature declared. ctypes.CDLL releases the GIL for
    the call, so a long wait inside it does not stop the process's other Python threads."""
    lib = ctypes.CDLL(str(path))
    size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
    lib.pl_segment_bytes.argtypes, lib.pl_segment_bytes.restype = [ctypes.c_int, size_t], size_t
    lib.pl_attach.argtypes, lib.pl_attach.restype = [ptr, ctypes.c_int, ctypes.c_int, size_t, ctypes.c_int32], None
    lib.pl_reduce.argtypes, lib.pl_reduce.restype = [ctypes.c_int, ptr, ctypes.POINTER(ptr), ctypes.c_int, size_t, size_t], None
    lib.pl_all_reduce.argtypes = [
        ptr, ctypes.c_int, ctypes.c_int, size_t, ctypes.c_int, ptr, size_t, ctypes.c_double, size_t, ctypes.c_longlong, ctypes.c_longlong
    ]
    lib.pl_all_reduce.restype = ctypes.c_int
    return lib

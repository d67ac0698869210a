"""Small C kernels built on the machine that runs them, loaded with ctypes.

A kernel is compiled on first use with the system C compiler (`CC`, default `cc`) for this very
CPU (-march=native), into a cache directory keyed by its source, the flags, the compiler and the
CPU, so a later run loads it at once and a machine with another CPU builds its own. Compiled with
-fopenmp, a kernel's parallel loops join the OpenMP runtime torch has already loaded (the loader
reuses a library it holds under the same name), so they run on torch's threads instead of a
second pool that would fight it for the cores. Without a compiler, or when a build fails, the
caller gets None and a one-line reason, and keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# Where built kernels (and measured choices, pocketllm.ops.gemv) are cached.
ENV_CACHE_DIR = "POCKETLLM_CACHE_DIR"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_SECONDS = 120

_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}


def cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "pocketllm")
    return Path(root)


def cpu_identity() -> str:
    """The CPU model and its feature flags: what -march=native compiles for."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or fields.get("Model") or platform.processor()
    flags = fields.get("flags") or fields.get("Features") or ""
    return f"{model}|{platform.machine()}|{flags}"


def cpu_model() -> str:
    return cpu_identity().split("|", 1)[0] or platform.machine()


def load(source: Path) -> tuple[ctypes.CDLL | None, str]:
    """(the built library, "") or (None, why not). Built once per process and cached on disk."""
    key = str(source)
    if key not in _loaded:
        _loaded[key] = _build_and_load(source)
    return _loaded[key]


def _build_and_load(source: Path) -> tuple[ctypes.CDLL | None, str]:
    cc = os.environ.get("CC", "cc")
    compiler = shutil.which(cc)
    if compiler is None:
        return None, f"no C compiler ({cc!r} not found)"
    text = source.read_bytes()
    digest = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), compiler.encode(), _compiler_version(compiler), cpu_identity().encode()]))
    target = cache_dir() / "native" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        why = _build(compiler, source, target)
        if why:
            return None, why
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as e:
        return None, f"built {target.name} but could not load it: {e}"


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _build(compiler: str, source: Path, target: Path) -> str:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed over it: ranks building at once never load a half file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        r = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=BUILD_SECONDS)
        if r.returncode != 0:
            first = (r.stderr.strip().splitlines() or ["no message"])[0]
            return f"{source.name} did not compile: {first}"
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.SubprocessError) as e:
        return f"{source.name} did not compile: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

"""Small C kernels built on the machine that runs them, loaded with ctypes.

A kernel is compiled on first use with the system C compiler (`CC`, default `cc`) for this very
CPU (-march=native; POCKETLLM_ISA narrows it), into a private cache directory keyed by its
source, the flags, the compiler and the CPU, so a later run loads it at once and a machine with
another CPU builds its own. Compiled with
-fopenmp, a kernel's parallel loops join the OpenMP runtime torch has already loaded (the loader
reuses a library it holds under the same name), so they run on torch's threads instead of a
second pool that would fight it for the cores. Without a compiler, or when a build fails, the
caller gets a one-line reason (BuildError, or None and the reason from load) and keeps its torch
or gloo path.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from pocketllm.errors import UsageError
from pocketllm.switches import env_value

# Where built kernels (and measured choices, pocketllm.ops.gemv) are cached.
ENV_CACHE_DIR = "POCKETLLM_CACHE_DIR"
# The kernels' flags: OpenMP for the ones that split work over torch's threads.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# Extra flags that turn the wider instruction sets off, so that every path a kernel source compiles
# (its #if branches) can be built and checked on one machine: for tests, benchmarks and ENV_ISA.
# avx512f stands for the CPUs with AVX-512 but not its BF16 (Skylake to Ice Lake), which have no
# AMX either: NO_AMX_TILES leaves the tile kernels out (a define, where -mno-amx-tile would
# fail the build on compilers older than AMX).
ISA_FLAGS = {"native": (), "avx512f": ("-mno-avx512bf16", "-DNO_AMX_TILES"), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx",)}
# Forces one of ISA_FLAGS' builds on every kernel (default native): the narrower x86 paths run,
# and are tested, on a CPU with wider ones. It only turns paths off, so on a CPU that lacks the
# named set the kernels are built for what the CPU has.
ENV_ISA = "POCKETLLM_ISA"
BUILD_SECONDS = 120

_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}
# Held while a load records its library and sets its signatures: tests build several variants
# from threads, and two keys' builds may finish together.
_lock = threading.Lock()


class BuildError(Exception):
    """No library: no compiler, a failed compile, or an unsafe cache directory; one line."""


def cache_dir() -> Path:
    """POCKETLLM_CACHE_DIR, else pocketllm/ under $XDG_CACHE_HOME or ~/.cache."""
    if env_value(os.environ, ENV_CACHE_DIR):
        return Path(env_value(os.environ, ENV_CACHE_DIR))
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pocketllm"


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


def cpu_flags() -> set[str]:
    """The feature flags the CPU reports (avx2, avx512f, avx512_bf16, ...): what tests of one
    instruction set's paths check before running them."""
    return set(cpu_identity().rsplit("|", 1)[-1].split())


def isa() -> str:
    """The build POCKETLLM_ISA forces: one of ISA_FLAGS ("native" when unset)."""
    value = env_value(os.environ, ENV_ISA).strip() or "native"
    if value not in ISA_FLAGS:
        raise UsageError(f"{ENV_ISA}={value!r} is not a build of the compiled kernels: use {', '.join(ISA_FLAGS)}")
    if value != "native" and platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        raise UsageError(f"{ENV_ISA}={value}: the builds other than native are x86's, and this CPU is {platform.machine()}")
    return value


def with_isa(flags: tuple[str, ...]) -> tuple[str, ...]:
    """flags narrowed to the build POCKETLLM_ISA forces. A caller's own narrower build (a test's
    ISA_FLAGS entry) stays as narrow: these flags only turn instruction sets off."""
    return flags + tuple(f for f in ISA_FLAGS[isa()] if f not in flags)


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def no_compiler(source: Path) -> str:
    """Why `source` cannot be built here ("" when a compiler is there): without one it never can,
    since a build is keyed on its compiler and no cached one serves."""
    return "" if compiler() is not None else f"no C compiler (cc, gcc or clang; or $CC) to build {source.name}"


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The built library's path, compiled now if this source was not built here before."""
    flags = with_isa(flags)
    cc = compiler()
    if cc is None:
        raise BuildError(no_compiler(source))
    digest = hashlib.sha256(b"\0".join([_source_text(source), " ".join(flags).encode(), cc.encode(), _compiler_version(cc), cpu_identity().encode()]))
    target = cache_dir() / "native" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    _private_dir(target.parent)
    if not target.exists():
        with _building(target):
            # Built meanwhile by whoever held the lock first: theirs is this build.
            if not target.exists():
                _compile(cc, source, flags, target)
    return target


def load(source: Path, flags: tuple[str, ...] = FLAGS, signatures: dict | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the built library, "") or (None, why not), built once per process and cached on disk.
    `signatures` ({function: (restype, argtypes)}) are set on the functions the library has, once
    per library and table."""
    flags = with_isa(flags)
    key = f"{source}|{' '.join(flags)}"
    if key not in _loaded:
        try:
            path = build(source, flags)
            result = ctypes.CDLL(str(path)), ""
        except BuildError as e:
            result = None, str(e)
        except OSError as e:
            result = None, f"could not load the build of {source.name}: {e}"
        with _lock:
            # Where another thread loaded the same key meanwhile, its library object is the one.
            _loaded.setdefault(key, result)
    lib = _loaded[key][0]
    # The tables applied are kept on the library object: a key loaded again (a fresh _loaded, as
    # tests make) is a new object whose functions carry no types yet.
    if lib is not None and signatures and id(signatures) not in vars(lib).get("_pocketllm_typed", ()):
        with _lock:
            typed = vars(lib).setdefault("_pocketllm_typed", set())
            if id(signatures) not in typed:
                for fn, (restype, argtypes) in signatures.items():
                    if hasattr(lib, fn):
                        getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
                typed.add(id(signatures))
    return _loaded[key]


def unbuilt(loaded: tuple[ctypes.CDLL | None, str], isa_symbol: str) -> str:
    """Why a kernel library from load() cannot run ("" when it can): it did not build, or its
    `isa_symbol` function, which names the instruction set the source compiled its paths for,
    says "unavailable: ..." (a source whose kernels need a set this build lacks)."""
    lib, why = loaded
    if lib is None:
        return why
    isa = getattr(lib, isa_symbol)().decode()
    # The reason alone, as a failed build gives it: callers say what is unavailable.
    return isa.removeprefix("unavailable: ") if isa.startswith("unavailable") else ""


def source_digest(source: Path) -> str:
    """A short digest of a source and the headers it includes: what a measured choice of its
    kernels is only valid for."""
    return hashlib.sha256(_source_text(source)).hexdigest()[:12]


def _source_text(source: Path, seen: set[Path] | None = None) -> bytes:
    """The source and every header it includes by a quoted relative path, and theirs in turn, so
    editing a header rebuilds each kernel that uses it however deep the include."""
    seen = set() if seen is None else seen
    text = source.read_bytes()
    parts = [text]
    for h in re.findall(rb'^#include "([^"]+)"', text, flags=re.M):
        header = (source.parent / h.decode()).resolve()
        if header not in seen:
            seen.add(header)
            parts.append(_source_text(header, seen))
    return b"\0".join(parts)


def _private_dir(path: Path) -> None:
    """Create the directory 0700 if need be, and refuse one another user could write to: a
    library loaded from it runs in this process."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as e:
        raise BuildError(f"cannot use the build cache {path}: {e.strerror or e}") from None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BuildError(f"the build cache {path} is not this user's private directory")


@functools.cache
def _compiler_version(cc: str) -> bytes:
    # Asked once a process per compiler: every build's key holds it, and a rank builds or finds
    # several sources (a process each time, ~2 ms).
    try:
        return subprocess.run([cc, "--version"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


@contextlib.contextmanager
def _building(target: Path):
    """Held while `target` is built: the ranks of a run starting together, or threads, that miss
    the same build wait for the first one's instead of each compiling it again (an flock on a
    file beside it, one open file per caller, so threads of one process exclude each other too)."""
    try:
        fd = os.open(target.with_name(target.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield  # no lock file where the build goes: build unlocked, as before
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _compile(cc: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    # Built beside the target and renamed over it: ranks building at once never load a half file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=BUILD_SECONDS)
        if r.returncode != 0:
            first = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[0]
            raise BuildError(f"{cc} could not build {source.name}: {first}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} could not build {source.name}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

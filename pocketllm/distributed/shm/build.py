"""The shared-memory all-reduce's C helper: built on first use like every C kernel here
(pocketllm.compiled: the system compiler, -march=native, a private cache keyed by source, flags,
compiler and CPU; a fraction of a second), then loaded with its entry points declared."""

from __future__ import annotations

import ctypes
from pathlib import Path

from pocketllm import compiled

SOURCE = Path(__file__).with_name("allreduce.c")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")
BuildError = compiled.BuildError


def build() -> Path:
    """The helper library's path, compiled now if this source has not been built here before."""
    return compiled.build(SOURCE, FLAGS)


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

"""Every compiled kernel source builds, and loads with every symbol resolved, for a CPU wider than
the one that runs the tests: the paths `#if`-ed in for AVX-512 BF16 and AMX are otherwise compiled
only where the suite runs on such a CPU (the -mno-* builds of ISA_FLAGS reach the narrower ones)."""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import pocketllm
from pocketllm import compiled
from pocketllm.errors import UsageError

SOURCES = sorted(Path(pocketllm.__file__).parent.rglob("*.c"))
# The widest x86 target the compilers of these machines know: AVX-512 BF16, VNNI and AMX.
WIDEST = "-march=sapphirerapids"


def test_the_sources_are_found():
    assert {s.name for s in SOURCES} >= {"gemv_bf16.c", "gemv_int4.c", "gemv_int8.c", "attention_bf16.c", "decode_bf16.c"}


def test_every_source_builds_and_loads_for_the_widest_target():
    if compiled.compiler() is None:
        pytest.skip("no C compiler here")

    def build(source: Path):
        try:
            return source, compiled.build(source, compiled.FLAGS + (WIDEST,)), ""
        except compiled.BuildError as e:
            return source, None, str(e)

    with ThreadPoolExecutor(2) as pool:
        for source, path, why in pool.map(build, SOURCES):
            assert path is not None, why
            # dlopen binds every symbol now: a macro left undefined on one path shows up as one.
            ctypes.CDLL(str(path))


def test_editing_a_header_included_through_another_changes_the_digest(tmp_path):
    # decode_bf16.c reaches bf16.h only through rounding.h: an edit there must rebuild it.
    (tmp_path / "inner.h").write_text("#define K 1\n")
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    source = tmp_path / "k.c"
    source.write_text('#include "outer.h"\nint k(void) { return K; }\n')
    before = compiled.source_digest(source)
    (tmp_path / "inner.h").write_text("#define K 2\n")
    assert compiled.source_digest(source) != before


def test_a_library_loaded_from_threads_at_once_is_one_object_with_its_signatures(monkeypatch, tmp_path):
    # Tests build a source's variants from threads, and under POCKETLLM_ISA two variants are one
    # build: every caller must get the one library object, its functions typed (an untyped
    # function returning a pointer hands back an int, and an untyped pointer argument is cut).
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "_loaded", {})
    source = tmp_path / "named.c"
    source.write_text('const char *named(void) { return "named"; }\n')
    signatures = {"named": (ctypes.c_char_p, [])}
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda _: compiled.load(source, compiled.FLAGS, signatures), range(4)))
    libs = {id(lib) for lib, _ in loaded}
    assert len(libs) == 1, loaded
    assert all(lib.named() == b"named" for lib, _ in loaded)
    # Loaded again into a fresh table (a new library object), it is typed again.
    monkeypatch.setattr(compiled, "_loaded", {})
    lib, why = compiled.load(source, compiled.FLAGS, signatures)
    assert lib is not None and id(lib) not in libs, why
    assert lib.named() == b"named"


def test_callers_that_miss_the_same_build_at_once_compile_it_once(monkeypatch, tmp_path):
    # The ranks of a run start together on a cold cache: one compiles, the others wait for it
    # and load its library (threads here, each with its own lock file handle as a rank has).
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path / "cache"))
    source = tmp_path / "once.c"
    source.write_text("int once(void) { return 7; }\n")
    real, compiles = compiled._compile, []

    def slow_compile(*args):
        compiles.append(args[-1])
        time.sleep(0.3)  # the window in which the other callers arrive
        real(*args)

    monkeypatch.setattr(compiled, "_compile", slow_compile)
    with ThreadPoolExecutor(4) as pool:
        targets = list(pool.map(lambda _: compiled.build(source), range(4)))
    assert len(set(targets)) == 1 and len(compiles) == 1, compiles
    assert ctypes.CDLL(str(targets[0])).once() == 7


def test_the_isa_switch_narrows_every_build_and_refuses_a_name_it_does_not_know(monkeypatch):
    monkeypatch.setenv(compiled.ENV_ISA, "avx3")
    with pytest.raises(UsageError, match=r"POCKETLLM_ISA='avx3' is not a build of the compiled kernels: use native, avx512f, avx2, scalar"):
        compiled.load(SOURCES[0])
    if "avx2" not in compiled.cpu_flags():
        pytest.skip("this CPU does not report avx2")
    monkeypatch.setenv(compiled.ENV_ISA, "avx2")
    assert compiled.with_isa(compiled.FLAGS) == compiled.FLAGS + compiled.ISA_FLAGS["avx2"]
    # A caller's own narrower build (a test's ISA_FLAGS entry) stays as narrow.
    scalar = compiled.FLAGS + compiled.ISA_FLAGS["scalar"]
    assert compiled.with_isa(scalar) == scalar + compiled.ISA_FLAGS["avx2"]
    if compiled.compiler() is None:
        pytest.skip("no C compiler here")
    lib, why = compiled.load(next(s for s in SOURCES if s.name == "gemv_bf16.c"))
    assert lib is not None, why
    lib.gemv_bf16_isa.restype = ctypes.c_char_p
    assert lib.gemv_bf16_isa().decode() == "avx2"

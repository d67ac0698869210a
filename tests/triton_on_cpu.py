"""Triton on a machine without a GPU, for the tests: a kernel compiled for a GPU target (Triton's
compiler and its bundled ptxas need no GPU), so a kernel that the interpreter runs but the
compiler refuses fails on CPU too; and a test file run under Triton's interpreter.

Triton 3.9 decides at decoration whether a jit function is compiled or interpreted, from
TRITON_INTERPRET, and its own library functions (tl.sum, tl.sigmoid, ...) are decorated when triton
is first imported: setting the variable later, even before a kernel module is first imported,
leaves tl.sum compiled and the interpreted kernel fails calling it. So the interpreter tests run
in processes of their own that have the variable from the start, and nothing else in the suite's
process sees it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
import triton.compiler
from triton.backends.compiler import GPUTarget

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(*test_files: Path, processes: int = 2, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`python -m pytest -q test_files...` with TRITON_INTERPRET=1 in `processes` new processes
    running side by side (the interpreter keeps about one core busy), each given its share of the
    tests (conftest.py's --shard K/N); their results, shard by shard. Each runs torch's ops on one
    thread: with two each, the processes' torch ops between the kernels ran several times slower.
    """
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--shard={k}/{processes}", *map(str, test_files)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )
        for k in range(processes)
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def helpers_without_repatching() -> bool:
    """Make a jit function called inside an interpreted kernel (arith's `rounded`, tl.sum, ...) run
    as it is where every language module it sees is patched already. Triton 3.9's interpreter
    patches triton.language's builtins for a launch (undone at its end), and again at every call
    of a jit function inside it: a scan of the module's members, about a millisecond, against
    microseconds for the function's work. The per-row kernels make such calls in every program, so
    the scans were most of the interpreted tests' time. A second patch of a patched module changes
    nothing (patched members are no longer builtins and are left alone), so skipping it runs the
    same code. What the inner patch adds is never undone (triton.language.core, which tl.sum sees
    and a kernel's module may not): such a module is patched once, then counts as patched. Installed
    in the interpreter's processes only (conftest, under TRITON_INTERPRET=1); False, and nothing
    changed, where the interpreter lacks what this wraps."""
    from triton.runtime import interpreter as interp

    launch, inner = getattr(interp, "GridExecutor", None), getattr(interp, "InterpretedFunction", None)
    if launch is None or inner is None or not hasattr(inner, "rewrite") or not hasattr(interp, "_patch_lang"):
        return False
    languages = (triton.language, triton.language.core)
    running: list[frozenset] = []  # the modules each running launch patched, innermost last
    lasting: set = set()  # the modules an inner call patched for good

    known: dict = {}

    def seen(fn) -> frozenset:
        # The interpreter adds names to a module's globals when it first rewrites a function of it.
        key = (id(fn), len(fn.__globals__))
        if key not in known:
            known[key] = frozenset(id(v) for v in fn.__globals__.values() if any(v is lang for lang in languages))
        return known[key]

    def launch_call(self, *args, _call=launch.__call__, **kwargs):
        running.append(seen(self.fn))
        try:
            return _call(self, *args, **kwargs)
        finally:
            running.pop()

    def inner_call(self, *args, _call=inner.__call__, **kwargs):
        modules = seen(self.fn)
        if not running or not modules <= running[-1] | lasting:
            result = _call(self, *args, **kwargs)
            if running:
                lasting.update(modules - running[-1])
            return result
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    launch.__call__, inner.__call__ = launch_call, inner_call
    return True


def scalars_index_as_numpy_allows() -> bool:
    """Make a kernel's scalar (a loaded position, a program id) usable as a loop bound under the
    interpreter of Triton 3.6 (torch 2.11's) with NumPy 2.4 or later. The interpreter holds a scalar
    as a one-element array and takes its index with int(array), which NumPy 2.4 refuses for arrays
    of one dimension ("only 0-dimensional arrays can be converted to Python scalars"), so every
    `range(.., scalar)` failed there: the decode attention's tile loop. Triton 3.9's interpreter
    squeezes the array first; this does the same for one that does not, through the
    interpreter's own patch of the tensor class (undone with it at a launch's end). Installed in the
    interpreter's processes only (conftest, under TRITON_INTERPRET=1); False, and nothing changed,
    where NumPy still converts such arrays or the interpreter lacks the function this wraps."""
    import numpy as np
    from triton.runtime import interpreter as interp

    try:
        int(np.ones(1, dtype=np.int32))
        return False
    except TypeError:
        pass
    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None:
        return False

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        patch(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interp._patch_lang_tensor = patch_lang_tensor
    return True


_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Recorder:
    """Stands in for a module's kernels: `kernel[grid](*args, **kwargs)` records the launch in the
    order of all of them."""

    def __init__(self, launches: list, kernel):
        self.launches, self.kernel = launches, kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def _kernels_of(module) -> dict:
    """A kernel module's launched kernels: its jit functions named _kernel or _..._kernel."""
    return {name: f for name, f in vars(module).items()
            if isinstance(f, triton.runtime.JITFunction) and name.startswith("_") and name.endswith("kernel")}


def compiled_for_gpu(module, launcher, *args, arch: int = 90) -> list:
    """Run launcher(*args) with module's kernels recording their launches instead of running, then
    compile each launch's kernel for NVIDIA sm_{arch} with the launch's arguments' types and
    options; the compiled kernels (their .asm holds ttir .. ptx, cubin). As Triton's launcher
    does, an int argument equal to 1 is a constant."""
    return compiled_for_gpu_all(module, [(launcher, args)], arch=arch)


def compiled_for_gpu_all(module, calls, arch: int = 90) -> list:
    """compiled_for_gpu of several calls [(launcher, args), ...] of one module's kernels: every
    launch recorded first, then all compiled side by side (compile_for_gpu)."""
    return compile_for_gpu(recorded_launches(module, calls), arch)


def recorded_launches(module, calls) -> list:
    """The launches of calls [(launcher, args), ...] of module's kernels (_kernel, and any
    _..._kernel a launcher runs after it), recorded one call at a time with stand-ins in their
    place, each as what triton.compile takes: (source, options), in launch order. As Triton's
    launcher does, an argument gets the hint that it is a multiple of 16 (a pointer's address, an
    int not marked do_not_specialize) where it is: the code a GPU runs is compiled with them, and its registers differ without."""
    kernels, recorded = _kernels_of(module), []
    for name, kernel in kernels.items():
        setattr(module, name, _Recorder(recorded, kernel))
    try:
        for launcher, args in calls:
            launcher(*args)
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    launches = []
    for kernel, positional, keywords in recorded:
        options = {name: keywords.pop(name) for name in _OPTIONS if name in keywords}
        bound = dict(zip([p.name for p in kernel.params], positional)) | keywords
        signature, constants, hints = {}, {}, {}
        for i, param in enumerate(kernel.params):
            value = bound[param.name]
            if type(value) is int and param.do_not_specialize:
                # Neither a constant at 1 nor hinted at multiples of 16: one kernel for any value.
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            elif param.is_constexpr or (type(value) is int and value == 1):
                signature[param.name], constants[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + _TYPES[value.dtype]
                if value.data_ptr() % 16 == 0:
                    hints[(i,)] = [["tt.divisibility", 16]]
            elif type(value) is int:
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0:
                    hints[(i,)] = [["tt.divisibility", 16]]
            elif type(value) is float:
                signature[param.name] = "fp32"
            else:
                raise TypeError(f"{param.name}: no Triton type for {value!r}")
        launches.append((triton.compiler.ASTSource(kernel, signature, constants, hints), options))
    return launches


def local_memory_bytes(compiled) -> int:
    """Bytes of local memory (register spills, the stack) a thread of a compiled kernel uses, as
    the CUDA binary utility in Triton's wheel reads its cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = [int(n) for n in re.findall(r"\b(?:STACK|LOCAL):(\d+)", usage)]
    assert found, usage
    return max(found)


def compile_for_gpu(launches, arch: int = 90, keep_errors: bool = False) -> list:
    """Each recorded launch compiled for NVIDIA sm_{arch}, on threads side by side (Triton's MLIR
    passes and ptxas run outside the GIL); the compiled kernels in launch order. With keep_errors,
    a launch whose compile raises gives its exception in its place."""

    def one(launch):
        source, options = launch
        try:
            return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as exc:
            if not keep_errors:
                raise
            return exc

    if not launches:
        return []
    with ThreadPoolExecutor(min(len(launches), os.cpu_count() or 1)) as pool:
        return list(pool.map(one, launches))

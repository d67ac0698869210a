"""tests/test_invariance.py again on the narrower x86 paths, each in a fresh process: pocketllm's
compiled kernels built for AVX-512 without BF16 or for AVX2 (POCKETLLM_ISA), and torch's own
kernels held to the same set (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, read once when torch
starts), so that a CPU with wider paths also checks what a Skylake or an AVX2-only CPU runs. A set
the CPU does not report is skipped, and so is the one the CPU's own build is (the suite's own run
of tests/test_invariance.py covers it). The kernels are forced, not measured: the compiled
one-row and few-row kernels (the batch-invariant ones) and torch's GEMM in the weight's dtype,
whose rows on these paths need not get the same bits in calls of other row counts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, cli_env

from pocketllm import compiled
from pocketllm.ops.gemv import kernels as gemv

# The build's name -> the CPU flag it needs and torch's variables for the same set.
NARROWER = {
    "avx512f": ("avx512f", {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}),
    "avx2": ("avx2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
}
KERNELS = "one-row=c,few-row=c,many-row=mm"


@pytest.mark.parametrize("isa", list(NARROWER))
def test_the_invariance_tests_pass_on_a_narrower_build(isa):
    flag, torch_env = NARROWER[isa]
    if flag not in compiled.cpu_flags():
        pytest.skip(f"this CPU does not report {flag}")
    if compiled.compiler() is None:
        pytest.skip("no C compiler here")
    if gemv.compiled_isa() == isa:
        pytest.skip(f"the kernels' own build here is {isa}: tests/test_invariance.py runs it")
    env = cli_env(**torch_env, **{compiled.ENV_ISA: isa, "POCKETLLM_KERNELS": KERNELS})
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_invariance.py"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]

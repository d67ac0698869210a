"""tests/test_invariance.py again on the narrower x86 paths, each in a fresh process (side by side
with the other's): pocketllm's compiled kernels built for AVX-512 without BF16 or for AVX2
(POCKETLLM_ISA), and torch's own kernels held to the same set (ATEN_CPU_CAPABILITY, oneDNN's
ONEDNN_MAX_CPU_ISA and MKL's MKL_ENABLE_INSTRUCTIONS for the fp32 GEMM, read once when torch
starts), so that a CPU with wider paths also checks what a Skylake or an AVX2-only CPU runs. A
set the CPU does not report is skipped, and so is the one the CPU's own build is (the suite's own
run of tests/test_invariance.py covers it). The kernels are forced, not measured: the compiled
one-row and few-row kernels (the batch-invariant ones; for int4 weights the ones that widen them,
whose builds tests/test_quant_kernels.py needs anyway) and torch's GEMM in the weight's dtype (on
the weights widened, for int4), whose rows on these paths need not get the same bits in calls of
other row counts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, cli_env

from pocketllm import compiled
from pocketllm.ops.gemv import kernels as gemv

# The build's name -> the CPU flag it needs and torch's variables for the same set.
NARROWER = {
    "avx512f": ("avx512f", {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
    "avx2": ("avx2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
}
KERNELS = "one-row=c,few-row=c,many-row=mm,int4-one-row=c,int4-few-row=c,int4-many-row=dequant-bf16"


def why_not(isa: str) -> str | None:
    """Why this machine does not run the check on this build, or None."""
    flag, _ = NARROWER[isa]
    if flag not in compiled.cpu_flags():
        return f"this CPU does not report {flag}"
    if compiled.compiler() is None:
        return "no C compiler here"
    if gemv.compiled_isa() == isa:
        return f"the kernels' own build here is {isa}: tests/test_invariance.py runs it"
    return None


@pytest.fixture(scope="module")
def narrower_runs():
    """tests/test_invariance.py in a fresh process per build this machine checks, all started at
    once. Each runs torch's two threads (test_invariance.py sets them); their OpenMP threads wait
    passively, so that processes side by side do not spin against each other for the cores."""
    procs = {}
    for isa, (_, torch_env) in NARROWER.items():
        if why_not(isa) is None:
            env = cli_env(**torch_env, **{compiled.ENV_ISA: isa, "POCKETLLM_KERNELS": KERNELS, "OMP_WAIT_POLICY": "PASSIVE"})
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_invariance.py"]
            procs[isa] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("isa", list(NARROWER))
def test_the_invariance_tests_pass_on_a_narrower_build(isa, narrower_runs):
    reason = why_not(isa)
    if reason is not None:
        pytest.skip(reason)
    out, err = narrower_runs[isa].communicate(timeout=240)
    assert narrower_runs[isa].returncode == 0, out[-4000:] + err[-2000:]

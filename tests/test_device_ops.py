"""The device prefill ops on CPU: their kernels under Triton's interpreter (interpreted_device_kernels.py,
in a process of its own) and compiled for a GPU (sm_90); the custom ops one op each to a
dispatch-mode counter, equal to the torch forms off CUDA, their fake forms as torch checks them;
the selector.
tests/device/test_device_ops_on_cuda.py runs the kernels on CUDA."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from device_op_cases import CASES
from triton_on_cpu import REPO, compile_for_gpu, local_memory_bytes, recorded_launches, run_interpreted
from pocketllm.ops.device import CUSTOM_OPS, TORCH_OPS, _probed, device_ops, kernels, probe
from pocketllm.profiling.op_count import count_ops


def test_the_kernels_under_the_interpreter():
    """Every test of the interpreted files (tests/interpreted_*.py: these kernels, the gated delta
    rule's decode rows, the whole model on them) passes, none skipped (their output on failure),
    each in one of the processes that share them out."""
    # The whole model's check first: its two halves, by far the costliest tests, are then the first
    # two collected, which conftest's --shard deals one to each process.
    files = sorted((REPO / "tests").glob("interpreted_*.py"), key=lambda f: (f.name != "interpreted_device_model.py", f.name))
    assert len(files) >= 2, files
    passed, collected = 0, set()
    for run in run_interpreted(*files):
        summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
        m = re.fullmatch(r"(\d+) passed(?:, (\d+) deselected)? in .*", summary)
        assert run.returncode == 0 and m, run.stdout[-6000:] + run.stderr[-3000:]
        passed += int(m[1])
        collected.add(int(m[1]) + int(m[2] or 0))
    # Each process collected the same tests, and between them ran every one.
    assert len(collected) == 1 and passed == collected.pop(), (passed, collected)


def _27b_decode_attention():
    """decode_attention_rows' module and a call of it at the 27B's heads (the test below says why)."""
    from pocketllm.ops.device.kernels import decode_attention

    q, pool = torch.randn(8, 24, 256).bfloat16(), torch.randn(40, 4, 64, 256).bfloat16()
    tables, pos = torch.arange(40, dtype=torch.int32).view(8, 5), torch.full((8,), 300)
    return decode_attention, [(decode_attention.decode_attention_rows, (q, pool, pool.clone(), tables, pos, 256**-0.5))]


@pytest.fixture(scope="module")
def for_sm90(tmp_path_factory):
    """What the two tests below compile for sm_90 (every kernel's bf16 and fp32 launches, the 27B's
    decode attention), all compiled together on threads side by side into a fresh Triton cache:
    name -> its compiled kernels, any of which may be the exception its compile (or recording its
    launches) raised, for that name's test to raise."""
    import importlib

    calls = {"27b-decode-attention": _27b_decode_attention()}
    for case in CASES:
        module = importlib.import_module(f"{kernels.__name__}.{case.module}")
        calls[case.op] = module, [(case.kernel(kernels), case.make(dtype, 3, 130)) for dtype in (torch.bfloat16, torch.float32)]
    launches = []
    for name, (module, module_calls) in calls.items():
        try:
            launches += [(name, launch) for launch in recorded_launches(module, module_calls)]
        except Exception as exc:
            launches.append((name, exc))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-sm90")))
        done = iter(compile_for_gpu([launch for _, launch in launches if not isinstance(launch, Exception)], keep_errors=True))
    compiled = {name: [] for name in calls}
    for name, launch in launches:
        compiled[name].append(launch if isinstance(launch, Exception) else next(done))
    return compiled


def compiled_or_raise(compiled: list) -> list:
    for k in compiled:
        if isinstance(k, Exception):
            raise k
    return compiled


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
def test_each_kernel_compiles_for_a_gpu(case, for_sm90):
    """The interpreter runs some things the compiler refuses: compile each launch for sm_90. None
    spills registers to local memory."""
    compiled = compiled_or_raise(for_sm90[case.op])
    assert compiled and all(k.asm["cubin"] for k in compiled)
    assert [local_memory_bytes(k) for k in compiled] == [0] * len(compiled)


def test_decode_attention_compiles_for_the_27b_heads_within_shared_memory(for_sm90):
    """The engine's blocks of 64 positions and the 27B's heads (24 query heads over 4 KV heads of
    256) in bf16 for sm_90, the shares' kernel and the combining one: the shared memory a program
    takes within the 227 KiB sm_90 allows, and no local memory: registers spilled there would be
    read and written in every tile of every decode step (a head of 256 widened to fp32 before its
    dot did that)."""
    shares, combine = compiled_or_raise(for_sm90["27b-decode-attention"])
    for kernel in (shares, combine):
        assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
        assert local_memory_bytes(kernel) == 0


def test_a_pass_writes_its_kv_from_any_start_with_one_compiled_kernel():
    """A pass going on from a cached prefix starts at any position; Triton compiles an integer
    argument apart at 1 and at multiples of 16, so a first request going on at another position
    than the warm-up's would wait for a compile. The KV write's start is one argument of one
    kernel, whatever its value."""
    from pocketllm.ops.device.kernels import kv_write

    pool = torch.zeros(4, 2, 16, 32, dtype=torch.bfloat16)
    table = torch.arange(4, dtype=torch.int32)
    k = v = torch.zeros(3, 2, 32, dtype=torch.bfloat16)
    launches = recorded_launches(kv_write, [(kv_write.write_kv, (pool, pool.clone(), table, start, k, v)) for start in (0, 1, 16, 17, 33)])
    assert len(launches) == 5 and len({source.hash() for source, _ in launches}) == 1


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
def test_each_custom_op_is_one_op_and_the_torch_form_off_cuda(case):
    mine, theirs = case.make(torch.bfloat16, 3, 96), case.make(torch.bfloat16, 3, 96)
    result, count = count_ops(getattr(CUSTOM_OPS, case.field), *mine)
    assert count.kernels == {f"pocketllm::{case.op}": 1}, count.ops
    for a, b in zip(case.outputs(result, mine), case.outputs(case.torch_form(*theirs), theirs), strict=True):
        assert torch.equal(a, b)
    _, torch_count = count_ops(getattr(TORCH_OPS, case.field), *case.make(torch.bfloat16, 3, 96))
    assert torch_count.total_kernels() >= 1 and not any(name.startswith("pocketllm::") for name in torch_count.ops)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
def test_each_custom_op_passes_torchs_opcheck(case):
    """The schema and the fake (shape-only) form against the real outputs: what torch.compile and
    a CUDA graph capture rely on."""
    op = getattr(torch.ops.pocketllm, case.op).default
    torch.library.opcheck(op, case.op_args(case.make(torch.float32, 3, 96)), test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_every_custom_op_in_one_graph():
    """fullgraph: no op breaks the graph (each traced by its fake form); the same bits as eager."""
    mine = {case.op: case.make(torch.bfloat16, 3, 96) for case in CASES}
    theirs = {case.op: case.make(torch.bfloat16, 3, 96) for case in CASES}

    def every_op(args):
        return [case.outputs(getattr(CUSTOM_OPS, case.field)(*args[case.op]), args[case.op]) for case in CASES]

    compiled = torch.compile(every_op, backend="aot_eager", fullgraph=True)(mine)
    for got, expected in zip(compiled, every_op(theirs), strict=True):
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


def test_device_ops_picks_the_kernels_on_cuda_only_where_they_pass_their_probe(monkeypatch):
    assert device_ops(torch.device("cpu")) is TORCH_OPS and TORCH_OPS.describe() == "device ops: torch"
    assert device_ops(torch.device("meta")).describe() == "device ops: torch (no Triton kernels for meta)"
    # The probe, run here on CPU (the custom ops run their torch forms off CUDA): each op agrees;
    # a kernel that computes something else, or does not run, is named.
    cpu = torch.device("cpu")
    assert probe.disagreement(CUSTOM_OPS, TORCH_OPS, cpu) is None
    wrong = dataclasses.replace(CUSTOM_OPS, silu_mul=lambda gate, up: gate * up)
    assert probe.disagreement(wrong, TORCH_OPS, cpu).startswith("silu_mul differs from its torch form by ")

    def fails(*args):
        raise RuntimeError("PTX compile failed\nat depth")

    assert probe.disagreement(dataclasses.replace(CUSTOM_OPS, apply_rotary=fails), TORCH_OPS, cpu) == "apply_rotary: RuntimeError: PTX compile failed"
    # On CUDA the kernels where they agree there, else the torch forms saying why.
    for why, want in ((None, "device ops: triton"), ("silu_mul differs", "device ops: torch (a kernel failed its probe: silu_mul differs)")):
        _probed.cache_clear()
        monkeypatch.setattr(probe, "disagreement", lambda ops, ref, device, _why=why: _why)
        assert device_ops(torch.device("cuda")).describe() == want
    _probed.cache_clear()



"""The device prefill kernels (pocketllm/ops/device) compiled, on CUDA: each against its torch
form run on the CPU from the same values (the interpreter tests' comparison, at their shapes and
at a 27B-sized width), a row's bits the same in a call of one row as among many, the conv in one
call and in chunks, the custom ops launching the kernels as one op each, and a CUDA graph replaying
them. On a machine without CUDA these are skipped; tests/test_device_ops.py runs the kernels
under Triton's interpreter there."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from device_caps import captured, cuda_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from device_op_cases import CASES, ROW_SHAPES, conv_inputs  # noqa: E402
from pocketllm.ops.device import CUSTOM_OPS, device_ops  # noqa: E402
from pocketllm.profiling.op_count import count_ops  # noqa: E402

on_cuda = pytest.mark.skipif(cuda_count() < 1, reason="needs 1 cuda device(s)")
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
SHAPES = [pytest.param(rows, width, id=f"T{rows}-n{width}") for rows, width in [*ROW_SHAPES, (1000, 5120)]]
# The device's exp and log are approximations a few ulps from the CPU's.
FP32_SLACK = 4


def _kernels():
    from pocketllm.ops.device import kernels

    for case in CASES:
        importlib.import_module(f"{kernels.__name__}.{case.module}")
    return kernels


def _cpu(outputs):
    return [t.cpu() for t in outputs]


@on_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", SHAPES)
def test_kernel_matches_its_torch_form(case, dtype, rows, width):
    mine, theirs = case.make(dtype, rows, width, "cuda"), case.make(dtype, rows, width)
    mine = _cpu(case.outputs(case.kernel(_kernels())(*mine), mine))
    theirs = case.outputs(case.torch_form(*theirs), theirs)
    for a, b in zip(mine, theirs, strict=True):
        case.check(a, b, fp32_slack=FP32_SLACK)


@on_cuda
@pytest.mark.parametrize("case", [c for c in CASES if c.rows_of], ids=lambda c: c.op)
@pytest.mark.parametrize("rows", [67, 4096])
def test_a_row_gets_the_same_bits_alone_as_among_many(case, rows):
    args = case.make(torch.bfloat16, rows, 130, "cuda")
    launch = case.kernel(_kernels())
    together = case.outputs(launch(*args), args)
    for r in (0, rows // 2, rows - 1):
        one = [a[r : r + 1] if i in case.rows_of else a for i, a in enumerate(args)]
        for out_all, out_one in zip(together, case.outputs(launch(*one), one), strict=True):
            assert torch.equal(out_all[r : r + 1], out_one), f"row {r}"


@on_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_over_a_prompt_in_one_call_equals_it_in_chunks(dtype):
    x, taps, state = conv_inputs(dtype, 4096, 10240, "cuda")
    conv = _kernels().causal_conv.causal_conv1d_prefill_
    whole_state, chunk_state = state.clone(), state.clone()
    whole = conv(x, taps, whole_state)
    chunks = torch.cat([conv(x[a:b], taps, chunk_state) for a, b in ((0, 1), (1, 3), (3, 2048), (2048, 4096))])
    assert torch.equal(whole, chunks) and torch.equal(whole_state, chunk_state)


@on_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
def test_each_custom_op_launches_its_kernel_as_one_op(case):
    assert device_ops(torch.device("cuda")) is CUSTOM_OPS, device_ops(torch.device("cuda")).describe()
    mine, theirs = case.make(torch.bfloat16, 67, 130, "cuda"), case.make(torch.bfloat16, 67, 130, "cuda")
    result, count = count_ops(getattr(CUSTOM_OPS, case.field), *mine)
    assert count.kernels == {f"pocketllm::{case.op}": 1}, count.ops
    for a, b in zip(case.outputs(result, mine), case.outputs(case.kernel(_kernels())(*theirs), theirs), strict=True):
        assert torch.equal(a, b)


@on_cuda
def test_a_cuda_graph_replays_the_custom_ops():
    """Warmed up, captured once over static inputs, replayed on new values: the eager bits."""
    cases = {case.op: case for case in CASES}
    norm, conv, kv = cases["add_rms_norm"], cases["causal_conv1d_prefill_"], cases["write_kv"]
    norm_args, conv_args, kv_args = (c.make(torch.bfloat16, 67, 130, "cuda") for c in (norm, conv, kv))

    def step():
        total, normed = CUSTOM_OPS.add_rms_norm(*norm_args)
        CUSTOM_OPS.write_kv(*kv_args)
        return total, normed, CUSTOM_OPS.causal_conv1d_prefill_(*conv_args)

    state = conv_args[2].clone()
    graph, outputs = captured(step)
    for t in (norm_args[0], conv_args[0], kv_args[4]):
        t.copy_(torch.randn_like(t))
    conv_args[2].copy_(state)
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in outputs] + [conv_args[2].clone(), kv_args[0].clone()]
    conv_args[2].copy_(state)
    expected = [*step(), conv_args[2], kv_args[0]]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)

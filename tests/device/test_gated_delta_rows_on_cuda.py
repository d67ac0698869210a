"""The gated delta rule's decode step on the stacked state (pocketllm/ops/device/kernels/
gated_delta_rows.py) compiled, on CUDA: against its torch form run on the CPU from the same values
at the interpreter tests' odd shapes and the 27B's (48 value heads of 128 x 128), slots outside the
batch untouched, a row's bits the same alone as among eight, the custom op one op launching it,
the GDN seam taking it after its probe, and a CUDA graph replaying it over new inputs and slots. On
a machine without CUDA these are skipped; tests/test_gated_delta_rows_indexed.py runs the kernel
under Triton's interpreter there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from device_caps import cuda_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gated_delta_rows_cases import FP32_REL, MODEL, SMALL, assert_close, case_id, rows_inputs, untouched  # noqa: E402
from pocketllm.ops.gated_delta.indexed import gated_delta_rows_indexed_op, gated_delta_rows_indexed_torch_  # noqa: E402
from pocketllm.profiling.op_count import count_ops  # noqa: E402

on_cuda = pytest.mark.skipif(cuda_count() < 1, reason="needs 1 cuda device(s)")
# One rank's GDN heads of the 27B at TP=1: 1 and 8 sequences among 10 slots.
MODEL_27B = [(1, 16, 48, 128, 128, 10, [7]), (8, 16, 48, 128, 128, 10, [9, 2, 4, 0, 8, 1, 6, 3])]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
# The device's exp is an approximation a few ulps from the CPU's; every term carries the decay.
REL = 2 * FP32_REL


def _kernel():
    from pocketllm.ops.device.kernels import gated_delta_rows

    return gated_delta_rows.gated_delta_rows_indexed_


@on_cuda
@pytest.mark.parametrize("case", [*SMALL, MODEL, *MODEL_27B], ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_its_torch_form_and_leaves_other_slots(case, dtype):
    q, k, v, g, beta, state, slots = rows_inputs(*case, dtype=dtype, device="cuda")
    before = state.clone()
    theirs = [t.to("cpu", copy=True) for t in (q, k, v, g, beta, state, slots)]
    out = _kernel()(q, k, v, g, beta, state, slots).cpu()
    ref = gated_delta_rows_indexed_torch_(*theirs)
    assert_close(out, ref, REL)
    assert_close(state.cpu()[theirs[6]], theirs[5][theirs[6]], REL)
    assert untouched(state, before, slots.tolist())


@on_cuda
def test_a_rows_bits_are_the_same_alone_as_among_eight():
    q, k, v, g, beta, state, slots = rows_inputs(*MODEL_27B[1], device="cuda")
    together_state = state.clone()
    together = _kernel()(q, k, v, g, beta, together_state, slots)
    for r in (0, 5, 7):
        alone_state, one = state.clone(), slice(r, r + 1)
        alone = _kernel()(q[one], k[one], v[one], g[one], beta[one], alone_state, slots[one])
        assert torch.equal(alone[0], together[r]) and torch.equal(alone_state[slots[r]], together_state[slots[r]])


@on_cuda
def test_the_custom_op_launches_the_kernel_as_one_op():
    mine, theirs = rows_inputs(*MODEL_27B[1], device="cuda"), rows_inputs(*MODEL_27B[1], device="cuda")
    out, count = count_ops(gated_delta_rows_indexed_op, *mine)
    assert count.kernels == {"pocketllm::gated_delta_rows_indexed_": 1}, count.ops
    assert torch.equal(out, _kernel()(*theirs)) and torch.equal(mine[5], theirs[5])


@on_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_seam_takes_the_op_after_its_probe(dtype, monkeypatch):
    import pocketllm.ops.gated_delta.backends as backends

    monkeypatch.setattr(backends, "_selected", {})
    kernel = backends.select_gdn_kernel(torch.device("cuda", 0), dtype, env={})
    assert kernel.decode_rows_indexed_ is gated_delta_rows_indexed_op, kernel.describe()
    assert "decode rows: triton, state in place" in kernel.reason


@on_cuda
def test_a_cuda_graph_replays_the_op_over_new_inputs_and_slots():
    args = rows_inputs(*MODEL_27B[1], device="cuda")
    static = [t.clone() for t in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gated_delta_rows_indexed_op(*[t.clone() for t in static])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_rows_indexed_op(*static)
    for seed, order in ((1, [3, 8, 0, 2, 9, 5, 1, 4]), (2, [0, 1, 2, 3, 4, 5, 6, 7])):
        new = rows_inputs(*MODEL_27B[1][:6], order, device="cuda", seed=seed)
        for buffer, value in zip(static, new):
            buffer.copy_(value)
        graph.replay()
        eager_state = new[5].clone()
        eager = _kernel()(*new[:5], eager_state, new[6])
        assert torch.equal(out, eager) and torch.equal(static[5], eager_state)

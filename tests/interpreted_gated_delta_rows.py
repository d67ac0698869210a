"""The gated delta rule's decode step on the stacked state (pocketllm/ops/device/kernels/
gated_delta_rows.py) on CPU under Triton's interpreter, against its torch form
(ops/gated_delta/indexed.gated_delta_rows_indexed_torch_) at odd shapes and the model's head dims:
out and the batch's slots of the state within a few ulps, every other slot untouched bit for bit,
a row's bits the same alone as among others, a padding slot repeated without harm to the real
rows. Runs only in a process started with TRITON_INTERPRET=1 (tests/triton_on_cpu.py says why):
test_gated_delta_rows_indexed.py runs it so, and so can a developer:

    TRITON_INTERPRET=1 python -m pytest -q tests/interpreted_gated_delta_rows.py

tests/device/test_gated_delta_rows_on_cuda.py makes the same comparisons compiled, on CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from gated_delta_rows_cases import MODEL, SMALL, assert_close, case_id, rows_inputs, untouched
from pocketllm.ops.device.kernels import gated_delta_rows
from pocketllm.ops.gated_delta.indexed import gated_delta_rows_indexed_torch_
from pocketllm.ops.gated_delta.naive import gated_delta_step_reference_

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this file with TRITON_INTERPRET=1 from the start of the process (tests/test_gated_delta_rows_indexed.py does)")

kernel = gated_delta_rows.gated_delta_rows_indexed_
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def test_the_kernel_is_interpreted():
    assert isinstance(gated_delta_rows._kernel, InterpretedFunction)


@pytest.mark.parametrize("case", [*SMALL, MODEL], ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_its_torch_form_and_leaves_other_slots(case, dtype):
    q, k, v, g, beta, state, slots = rows_inputs(*case, dtype=dtype)
    before, theirs = state.clone(), state.clone()
    out = kernel(q, k, v, g, beta, state, slots)
    ref = gated_delta_rows_indexed_torch_(q, k, v, g, beta, theirs, slots)
    assert out.is_contiguous()
    assert_close(out, ref)
    assert_close(state[slots], theirs[slots])
    assert untouched(state, before, slots)


def test_steps_carried_through_the_state_stay_with_the_torch_form():
    """Four tokens, each from the state the last left, the slots in a new order each time."""
    b, hk, hv, dk, dv, count, _ = SMALL[1]
    mine = theirs = None
    for t, order in enumerate(([3, 0, 4], [0, 4, 3], [4, 3, 0], [3, 4, 0])):
        q, k, v, g, beta, state, slots = rows_inputs(b, hk, hv, dk, dv, count, order, seed=t)
        if mine is None:
            mine, theirs, before = state, state.clone(), state.clone()
        assert_close(kernel(q, k, v, g, beta, mine, slots), gated_delta_rows_indexed_torch_(q, k, v, g, beta, theirs, slots))
    assert_close(mine, theirs)
    assert torch.equal(mine[[1, 2]], before[[1, 2]])


def test_the_step_matches_the_plain_reference():
    q, k, v, g, beta, state, slots = rows_inputs(*SMALL[1])
    ref_state = state.clone()
    out = kernel(q, k, v, g, beta, state, slots)
    for r, s in enumerate(slots.tolist()):
        one = slice(r, r + 1)
        ref = gated_delta_step_reference_(q[one], k[one], v[one], g[one], beta[one], ref_state[s])
        assert_close(out[r], ref[0], rel=1e-6)
    assert_close(state, ref_state, rel=1e-6)


def test_a_rows_bits_are_the_same_alone_as_among_others():
    q, k, v, g, beta, state, slots = rows_inputs(*SMALL[1])
    together_state = state.clone()
    together = kernel(q, k, v, g, beta, together_state, slots)
    for r in range(3):
        alone_state = state.clone()
        one = slice(r, r + 1)
        alone = kernel(q[one], k[one], v[one], g[one], beta[one], alone_state, slots[one])
        assert torch.equal(alone[0], together[r]) and torch.equal(alone_state[slots[r]], together_state[slots[r]])


def test_rows_repeating_a_padding_slot_leave_the_real_rows_right():
    """A captured step's spare rows all run in the padding slot (4 here): the real row's out and
    slot as the torch form's, slots outside the step untouched."""
    q, k, v, g, beta, state, _ = rows_inputs(*SMALL[1])
    slots = torch.tensor([1, 4, 4])
    before, theirs = state.clone(), state.clone()
    out = kernel(q, k, v, g, beta, state, slots)
    ref = gated_delta_rows_indexed_torch_(q[:1], k[:1], v[:1], g[:1], beta[:1], theirs, slots[:1])
    assert_close(out[:1], ref)
    assert_close(state[1], theirs[1])
    assert untouched(state, before, [1, 4]) == [0, 2, 3]


def test_no_rows_is_no_launch():
    q, k, v, g, beta, state, slots = rows_inputs(*SMALL[1])
    before = state.clone()
    out = kernel(q[:0], k[:0], v[:0], g[:0], beta[:0], state, slots[:0])
    assert out.shape == (0, 6, 24) and torch.equal(state, before)

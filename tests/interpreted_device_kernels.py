"""The device prefill kernels (pocketllm/ops/device/kernels) on CPU under Triton's interpreter:
each against its torch form and the plain references at odd shapes in bf16 and fp32, inputs taken
as the strided views a layer hands them; a row's bits the same in a call of one row as in a call of
21. Runs only in a process started with TRITON_INTERPRET=1 (tests/triton_on_cpu.py says why):
test_device_ops.py runs it so, and so can a developer:

    TRITON_INTERPRET=1 python -m pytest -q tests/interpreted_device_kernels.py

tests/device/test_device_ops_on_cuda.py makes the same comparisons with the kernels compiled, on CUDA."""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from device_op_cases import (CASES, ROW_SHAPES, TOL_ULPS, conv_inputs, conv_rows_inputs, decode_attention_inputs, gen, only_what_rows_hold,
                             ulps)
from pocketllm.ops.causal_conv import causal_conv1d_reference
from pocketllm.ops.device import kernels, torch_forms
from pocketllm.ops.fused.reference import add_rms_norm_reference, silu_mul_reference
from pocketllm.ops.norms import rms_norm_gated_reference, rms_norm_zero_centred_reference

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this file with TRITON_INTERPRET=1 from the start of the process (tests/test_device_ops.py does)")

for _module in pkgutil.iter_modules(kernels.__path__):
    importlib.import_module(f"{kernels.__name__}.{_module.name}")

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
SHAPES = [pytest.param(rows, width, id=f"T{rows}-n{width}") for rows, width in ROW_SHAPES]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
def test_the_kernels_are_interpreted(case):
    assert isinstance(getattr(kernels, case.module)._kernel, InterpretedFunction)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", SHAPES)
def test_kernel_matches_its_torch_form(case, dtype, rows, width):
    mine, theirs = case.make(dtype, rows, width), case.make(dtype, rows, width)
    mine = case.outputs(case.kernel(kernels)(*mine), mine)
    theirs = case.outputs(case.torch_form(*theirs), theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert a.is_contiguous()
        case.check(a, b)


@pytest.mark.parametrize("case", [c for c in CASES if c.rows_of], ids=lambda c: c.op)
def test_a_row_gets_the_same_bits_alone_as_among_many(case):
    # One dtype: what could make a row's bits depend on the others is the order of its sums. (A
    # kernel's program count grows with the rows, not its per-row work: 21 rows show what 67 would,
    # in a third of the interpreter's time.)
    args = case.make(torch.bfloat16, 21, 130)
    launch = case.kernel(kernels)
    together = case.outputs(launch(*args), args)
    for r in (0, 10, 20):
        one = [a[r : r + 1] if i in case.rows_of else a for i, a in enumerate(args)]
        for out_all, out_one in zip(together, case.outputs(launch(*one), one), strict=True):
            assert torch.equal(out_all[r : r + 1], out_one), f"row {r}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_over_a_prompt_in_one_call_equals_it_in_chunks(dtype):
    """A conv row depends on the K-1 rows before it: one call over 67 rows, and the same rows as
    calls of 1, 2 and 64 rows carrying the state, give the same bits and the same final state."""
    x, taps, state = conv_inputs(dtype, 67, 130)
    conv = kernels.causal_conv.causal_conv1d_prefill_
    whole_state, chunk_state = state.clone(), state.clone()
    whole = conv(x, taps, whole_state)
    chunks = torch.cat([conv(x[a:b], taps, chunk_state) for a, b in ((0, 1), (1, 3), (3, 67))])
    assert torch.equal(whole, chunks) and torch.equal(whole_state, chunk_state)


@pytest.mark.parametrize("rows", [1, 2, 67])
def test_conv_advances_the_state_as_the_torch_form(rows):
    """Fewer rows than K-1 keep part of the old state; the new state is the window's tail."""
    x, taps, state = conv_inputs(torch.bfloat16, rows, 96)
    mine, theirs = state.clone(), state.clone()
    kernels.causal_conv.causal_conv1d_prefill_(x, taps, mine)
    torch_forms.causal_conv1d_prefill_(x, taps, theirs)
    assert torch.equal(mine, theirs)


# A decode step's conv: each row's window advanced where it lies in the layer's stacked state.
conv_rows = kernels.causal_conv_rows.causal_conv1d_rows_indexed_


def test_conv_rows_carried_through_steps_stay_with_the_torch_form_and_the_reference():
    """Four tokens, each from the windows the last left, the rows' slots in a new order each time;
    each row against the conv's definition (float64) from its own window too."""
    x, taps, states, _ = conv_rows_inputs(torch.bfloat16, 3, 130)
    theirs, ref = states.clone(), states.clone()
    for t, order in enumerate(([3, 0, 5], [0, 5, 3], [5, 3, 0], [3, 5, 0])):
        x = torch.randn(3, 130, generator=gen(30 + t)).bfloat16()
        slots = torch.tensor(order)
        mine = conv_rows(x, taps, states, slots)
        assert torch.equal(mine, torch_forms.causal_conv1d_rows_indexed_(x, taps, theirs, slots))
        for r, s in enumerate(order):
            assert ulps(mine[r : r + 1], causal_conv1d_reference(x[r : r + 1], taps, ref[s])) <= 1
    assert torch.equal(states, theirs) and torch.equal(states, ref)


def test_conv_rows_give_a_row_the_same_bits_alone_as_among_others():
    x, taps, states, slots = conv_rows_inputs(torch.bfloat16, 5, 130)
    together_states = states.clone()
    together = conv_rows(x, taps, together_states, slots)
    for r in range(5):
        alone_states = states.clone()
        alone = conv_rows(x[r : r + 1], taps, alone_states, slots[r : r + 1])
        assert torch.equal(alone, together[r : r + 1])
        assert torch.equal(alone_states[slots[r]], together_states[slots[r]])


def test_conv_rows_sharing_a_padding_slot_leave_the_real_rows_right():
    """A captured step's spare rows all run in one padding slot: its window is garbage after, the
    real rows' outputs and windows are as if the spare rows were not there."""
    x, taps, states, _ = conv_rows_inputs(torch.bfloat16, 5, 130)
    slots = torch.tensor([2, 6, 0, 6, 6])
    mine, theirs = states.clone(), states.clone()
    out = conv_rows(x, taps, mine, slots)
    real = torch.tensor([0, 2])
    ref = torch_forms.causal_conv1d_rows_indexed_(x[real], taps, theirs, slots[real])
    assert torch.equal(out[real], ref)
    keep = [s for s in range(states.shape[0]) if s != 6]
    assert torch.equal(mine[keep], theirs[keep])


# Against the plain references (ops/norms.py, ops/fused/reference.py, ops/causal_conv.py), which
# compute differently from the torch forms: at most one ulp more.


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_the_references(dtype):
    g = gen(20)
    h, x = (torch.randn(3, 130, generator=g).to(dtype) for _ in range(2))
    w = (torch.randn(130, generator=g) * 0.1).to(dtype)
    scale = 1.0 + w.float()
    total, out = kernels.add_rms_norm.add_rms_norm(h, x, scale, 1e-6)
    ref_total, ref_out = add_rms_norm_reference(h, x, scale, 1e-6)
    assert torch.equal(total, ref_total) and ulps(out, ref_out) <= TOL_ULPS["add_rms_norm"][dtype] + 1
    _, out = kernels.add_rms_norm.add_rms_norm(h, None, scale, 1e-6)
    assert ulps(out, rms_norm_zero_centred_reference(h, w, 1e-6)) <= TOL_ULPS["rms_norm"][dtype] + 1
    xs, z = (torch.randn(3, 2, 130, generator=g).to(dtype) for _ in range(2))
    gated = kernels.gated_norm.rms_norm_gated(xs, z, w, 1e-6)
    assert ulps(gated, rms_norm_gated_reference(xs, z, w, 1e-6)) <= TOL_ULPS["rms_norm_gated"][dtype] + 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_conv_match_the_references(dtype):
    g = gen(21)
    gate, up = (torch.randn(3, 130, generator=g).to(dtype) for _ in range(2))
    assert ulps(kernels.silu_mul.silu_mul(gate, up), silu_mul_reference(gate, up)) <= TOL_ULPS["silu_mul"][dtype]
    x, taps, state = conv_inputs(dtype, 67, 130)
    ref_state = state.clone()
    out, ref = kernels.causal_conv.causal_conv1d_prefill_(x, taps, state), causal_conv1d_reference(x, taps, ref_state)
    if dtype == torch.bfloat16:
        assert ulps(out, ref) <= 1
    else:
        assert (out - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gates_match_float64_far_into_both_tails(dtype):
    """a + dt_bias from -30 to 30 (softplus's log1p tail and its threshold at 20), against float64
    from the same fp32 sum a + dt_bias (whose rounding alone moves the far tail by ~16 ulps)."""
    g_ = gen(22)
    a = torch.linspace(-30, 30, 67 * 6).view(67, 6).to(dtype)
    b = (torch.randn(67, 6, generator=g_) * 4).to(dtype)
    neg_a, dt_bias = -torch.rand(6, generator=g_) - 0.1, (torch.randn(6, generator=g_) * 0.5).to(dtype)
    g, beta = kernels.gdn_gates.gdn_gates(a, b, neg_a, dt_bias)
    ref_g = neg_a.double() * F.softplus((a.float() + dt_bias).double())
    assert ulps(beta.to(dtype), torch.sigmoid(b.double()).to(dtype)) <= 2
    assert ulps(g, ref_g.float()) <= 4


# Decode attention: the torch form gathers every block a row's table lists and masks the positions
# past its own; the kernel must read only positions 0..pos of each row. Its pools here hold NaN at
# every other position (the torch form's, clean, would turn NaN itself: 0 * NaN).
ATTENTION = next(case for case in CASES if case.op == "decode_attention_rows")
ATTENTION_ROWS = [pytest.param(p, id="pos" + "-".join(map(str, p))) for p in ((0, 15, 16), (71,), (95, 17, 40))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 80])
@pytest.mark.parametrize("positions", ATTENTION_ROWS)
def test_decode_attention_reads_only_the_positions_a_row_holds(dtype, d, positions):
    q, k_pool, v_pool, tables, _, scale = decode_attention_inputs(dtype, len(positions), d)
    pos = torch.tensor(positions)
    theirs = torch_forms.decode_attention_rows_torch(q, k_pool, v_pool, tables, pos, scale)
    mine = kernels.decode_attention.decode_attention_rows(q, *only_what_rows_hold(k_pool, v_pool, tables, pos), tables, pos, scale)
    ATTENTION.check(mine, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_tiles_inside_a_block_of_64(dtype):
    """The engine's blocks of 64 positions, read in tiles of 32: a tile's first position inside a block."""
    q, k_pool, v_pool, tables, _, scale = decode_attention_inputs(dtype, 5, 32, block_size=64)
    pos = torch.tensor([31, 32, 63, 64, 95])
    theirs = torch_forms.decode_attention_rows_torch(q, k_pool, v_pool, tables, pos, scale)
    mine = kernels.decode_attention.decode_attention_rows(q, *only_what_rows_hold(k_pool, v_pool, tables, pos), tables, pos, scale)
    ATTENTION.check(mine, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_combines_a_long_rows_shares(dtype):
    """Rows of several shares of SPLIT positions, cut inside a KV block of 64: a row ending at a
    share's last position, at the next share's first, and shares later."""
    split = kernels.decode_attention.SPLIT
    q, k_pool, v_pool, tables, _, scale = decode_attention_inputs(dtype, 4, 32, block_size=64, capacity=3 * split + 64)
    pos = torch.tensor([split - 1, split, 2 * split + 40, 3 * split + 63])
    theirs = torch_forms.decode_attention_rows_torch(q, k_pool, v_pool, tables, pos, scale)
    mine = kernels.decode_attention.decode_attention_rows(q, *only_what_rows_hold(k_pool, v_pool, tables, pos), tables, pos, scale)
    ATTENTION.check(mine, theirs)


def test_decode_attention_bits_do_not_depend_on_the_tables_width():
    """The torch form's sums run over all M blocks of a table; the kernel's over what a row holds
    (a table wider by more shares than the row holds too)."""
    split = kernels.decode_attention.SPLIT
    q, k_pool, v_pool, tables, _, scale = decode_attention_inputs(torch.bfloat16, 3, 80, capacity=split + 32)
    pos = torch.tensor([10, split + 5, split - 1])
    wider = torch.cat((tables, tables, tables[:, :3]), dim=1)
    launch = kernels.decode_attention.decode_attention_rows
    assert torch.equal(launch(q, k_pool, v_pool, tables, pos, scale), launch(q, k_pool, v_pool, wider, pos, scale))


class _Poisoned:
    """The torch module with every new tensor full of NaN: a kernel that reads memory it did not
    write in the same call (a share's partials) shows it."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))


class _Grids:
    """A kernel's launches recorded (the grid of each), then made as they would be."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_decode_attention_cuts_a_row_longer_than_its_shares_into_longer_shares(monkeypatch):
    """A device's rows hold at most `shares` shares (twice its SMs' programs): a row longer than
    that many shares of SPLIT positions is cut into `shares` shares of more tiles each (ending
    inside a KV block), combined as the short shares are; a table wider than that many shares
    launches no more programs for them, and a row's bits do not depend on how wide its table is.
    The partials start as NaN: the combine reads only the shares written in the call. (bf16
    alone: the cuts and the combine are the same code for fp32 rows.)"""
    split = kernels.decode_attention.SPLIT
    q, k_pool, v_pool, tables, _, scale = decode_attention_inputs(torch.bfloat16, 4, 32, block_size=64, capacity=3 * split + 64)
    pos = torch.tensor([100, split + 40, 2 * split + 40, 3 * split + 63])
    grids = _Grids(kernels.decode_attention._kernel)
    monkeypatch.setattr(kernels.decode_attention, "_kernel", grids)
    monkeypatch.setattr(kernels.decode_attention, "torch", _Poisoned())
    launch = kernels.decode_attention.decode_attention_rows
    mine = launch(q, *only_what_rows_hold(k_pool, v_pool, tables, pos), tables, pos, scale, shares=2)
    ATTENTION.check(mine, torch_forms.decode_attention_rows_torch(q, k_pool, v_pool, tables, pos, scale))
    wider = torch.cat((tables, tables), dim=1)
    assert torch.equal(launch(q, k_pool, v_pool, wider, pos, scale, shares=2), launch(q, k_pool, v_pool, tables, pos, scale, shares=2))
    assert [grid[2] for grid in grids.grids] == [2, 2, 2]

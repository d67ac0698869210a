"""The small fast ops against their naive references: pocketllm's compiled projection kernels as a
layer calls them, the causal conv and the two RMSNorms (HF's formulas), and the row blocking the
norms run by, against one whole block."""

from __future__ import annotations

import os

import pytest
import torch

from pocketllm.ops.causal_conv import causal_conv1d_prefill_, causal_conv1d_reference
from pocketllm.ops.registry.kernel_set import projection_reference


def test_every_compiled_projection_kernel_runs_bound_at_its_row_count():
    # pocketllm's own kernels (bf16 only: fp32/fp16 weights run torch's calls, tested in torch),
    # each forced into a KernelSet and run through the bound projection the layers call: one row
    # x[0] into out[0], few rows and many rows into the caller's `out` or a new tensor.
    from pocketllm.ops.registry import FEW_ROW, MANY_ROW, ONE_ROW, Choice, KernelSet

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 48, generator=g).to(torch.bfloat16)
    cases = [(ONE_ROW, name, 1, {}) for name in ONE_ROW.available("bfloat16", cpu) if name.startswith("c")]
    cases += [(FEW_ROW, name, rows, {"rows": 4}) for name in FEW_ROW.available("bfloat16", cpu) if name != "mm" for rows in (2, 3, 4)]
    cases += [(MANY_ROW, "mm-f32", 17, {})]
    assert {(k.rows, n) for k, n, _, _ in cases} >= {("one-row", "c"), ("one-row", "c-prefetch"), ("few-row", "c"), ("many-row", "mm-f32")}
    for kind, name, rows, extra in cases:
        key = "probe" if kind is MANY_ROW else (40, 48)
        # A batch-invariant set (the default) runs a few-row kernel only beside a one-row kernel
        # that sums a row in its order (pocketllm's own); one that sums in another order (AMX
        # tiles) runs where batch invariance is off.
        one = [] if kind is not FEW_ROW else [Choice(ONE_ROW, "bfloat16", "forced", {key: "c"})]
        env = {**os.environ, "POCKETLLM_BATCH_INVARIANT": "0"} if kind is FEW_ROW and name == "amx" else os.environ
        bound = KernelSet(one + [Choice(kind, "bfloat16", "forced", {key: name}, **extra)], env=env).bind(w)
        label = {1: "one-row", 17: "many-row"}.get(rows, f"{rows}-row")
        assert bound.names[label] == name, (label, bound.names)
        x = torch.randn(rows, 48, generator=g).to(torch.bfloat16)
        want = projection_reference(x.float(), w.float())
        out = torch.full((rows, 40), float("nan"), dtype=torch.bfloat16)
        assert bound(x, out=out) is out
        for got in (out, bound(x)):
            assert got.shape == (rows, 40) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0, msg=f"{name} at {rows} rows")


def _conv_case(rows, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 12, generator=g).to(dtype)
    taps = torch.randn(4, 12, generator=g).to(dtype).float()  # as the layer holds them
    state = torch.randn(3, 12, generator=g).to(dtype)
    return x, taps, state


@pytest.mark.parametrize("rows", [1, 3, 10], ids=lambda r: f"T{r}")
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
def test_causal_conv_prefill_matches_the_definition(rows, with_state):
    x, taps, state = _conv_case(rows, torch.float32, rows)
    if not with_state:
        state.zero_()
    state_ref = state.clone()
    got = causal_conv1d_prefill_(x, taps, state)
    want = causal_conv1d_reference(x, taps, state_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_ref)


@pytest.mark.parametrize("path", ["conv1d", "blocked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_conv_prefill_paths_match_the_definition(monkeypatch, path, dtype):
    # A CPU takes the blocked multiply-add path, a device conv1d (here: told it is not a CPU); a
    # small block makes a short prompt span several blocks, including a ragged last one.
    import pocketllm.ops.causal_conv as conv
    import pocketllm.ops.row_blocks as row_blocks

    if path == "conv1d":
        monkeypatch.setattr(conv, "uses_row_blocks", lambda x: False)
    monkeypatch.setattr(row_blocks, "BLOCK_BYTES", 4 * 12 * 7)
    x, taps, state = _conv_case(40, dtype, 5)
    want = causal_conv1d_reference(x, taps, state.clone())
    got = causal_conv1d_prefill_(x, taps, state)
    # bf16: both round the fp32 sum once; an fp32 and an fp64 sum can round to neighbours.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, x[-3:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_conv_steps_match_the_blocked_prefill(dtype):
    # Decode must give a token what prefill gives it: the same fp32 sum, in the same order, rounded
    # once (a bf16 sum rounded per tap differed from prefill in a third of the outputs). Not bit
    # for bit: a fused and an unfused multiply-add may differ in the last fp32 bit.
    from pocketllm.ops.causal_conv import causal_conv1d_step_

    x, taps, state = _conv_case(20, dtype, 7)
    stepped_state = state.clone()
    prefill = causal_conv1d_prefill_(x, taps, state)
    stepped = torch.cat([causal_conv1d_step_(x[t : t + 1], taps, stepped_state) for t in range(20)])
    if dtype == torch.float32:
        torch.testing.assert_close(stepped, prefill, atol=1e-6, rtol=1e-6)
    else:
        # A fused and an unfused multiply-add may differ in the last fp32 bit and, rarely, round to
        # neighbouring bf16 values; a per-tap bf16 sum matched in only ~2/3 of the outputs here.
        assert (stepped == prefill).float().mean() >= 0.99
    assert torch.equal(stepped_state, state)


def test_causal_conv_step_shifts_state_in_place():
    from pocketllm.ops.causal_conv import causal_conv1d_step_

    state = torch.arange(6, dtype=torch.float32).view(3, 2)
    ptr = state.data_ptr()
    out = causal_conv1d_step_(torch.tensor([[10.0, 11.0]]), torch.ones(4, 2), state)
    assert state.data_ptr() == ptr
    assert state.tolist() == [[2.0, 3.0], [4.0, 5.0], [10.0, 11.0]]
    # silu of the four inputs' sum per channel: 0 + 2 + 4 + 10 and 1 + 3 + 5 + 11.
    torch.testing.assert_close(out, torch.nn.functional.silu(torch.tensor([[16.0, 20.0]])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norms_match_hf_formulas(dtype):
    from pocketllm.layers.norm import RMSNorm
    from pocketllm.ops.norms import rms_norm_gated, rms_norm_gated_reference, rms_norm_zero_centred_reference

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(33, 64, generator=g)).to(dtype)
    z = torch.randn(33, 64, generator=g).to(dtype)
    w = (0.2 * torch.randn(64, generator=g)).to(dtype)
    # The module itself, loaded as the loader leaves it: the zero-centred norm is split between
    # after_loading (1 + w) and forward, so neither half alone is what the engine runs.
    norm = RMSNorm("norm.weight", 64, 1e-6, dtype, "cpu")
    norm.weight.data.copy_(w)
    with pytest.raises(RuntimeError, match="before after_loading"):
        norm(x)  # no scale yet: it must not run as an unscaled norm
    norm.after_loading()
    # bf16: one rounding step apart at most.
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(norm(x).float(), rms_norm_zero_centred_reference(x, w, 1e-6).float(), **tol)
    torch.testing.assert_close(rms_norm_gated(x, z, 1 + w, 1e-6).float(), rms_norm_gated_reference(x, z, 1 + w, 1e-6).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_blocked_ops_equal_one_block(dtype):
    # Many rows are normed (and SiLU-multiplied) block by block; every row is computed alone, so the result must be
    # exactly the single-block one, ragged last block included.
    import torch.nn.functional as F

    from pocketllm.ops.norms import _l2_normalize_block, _rms_norm_gated_block, l2_normalize, rms_norm_gated, rms_norm_scaled
    from pocketllm.ops.row_blocks import block_rows

    g = torch.Generator().manual_seed(9)
    x = torch.randn(3 * block_rows(torch.empty(1, 1024)) + 5, 1024, generator=g).to(dtype)
    scale = 1 + 0.1 * torch.randn(1024, generator=g)
    assert torch.equal(rms_norm_scaled(x, scale, 1e-6), F.rms_norm(x.float(), (1024,), scale, 1e-6).to(dtype))
    xh, z = x.view(-1, 8, 128), torch.randn(x.shape[0], 8, 128, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(dtype)
    assert torch.equal(rms_norm_gated(xh, z, w, 1e-6), _rms_norm_gated_block(xh, z, w, 1e-6))
    assert torch.equal(l2_normalize(xh), _l2_normalize_block(xh, 1e-6))
    from pocketllm.ops.fused.reference import silu_mul_reference
    from pocketllm.ops.row_blocks import by_row_blocks

    up = torch.randn(x.shape, generator=g).to(dtype)
    assert torch.equal(by_row_blocks(silu_mul_reference, x, up), silu_mul_reference(x, up))


def test_row_blocks_run_whole_off_cpu():
    # On an accelerator many small launches would cost more than the cache they save.
    from pocketllm.ops.row_blocks import block_rows, by_row_blocks

    x = torch.empty(10 * block_rows(torch.empty(1, 64)), 64, device="meta")
    calls = []
    out = by_row_blocks(lambda xb: calls.append(xb.shape[0]) or xb, x)
    assert calls == [x.shape[0]] and out.shape == x.shape
    by_row_blocks(lambda xb: calls.append(xb.shape[0]) or xb, torch.empty(x.shape))
    assert len(calls) == 11

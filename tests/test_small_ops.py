"""The small fast ops against their naive references: the projection GEMM and the causal conv."""

from __future__ import annotations

import pytest
import torch

from pocketllm.ops.causal_conv import causal_conv1d_prefill_, causal_conv1d_reference
from pocketllm.ops.gemm import linear_rows, linear_rows_reference


@pytest.mark.parametrize("rows", [1, 2, 17], ids=lambda r: f"T{r}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
def test_linear_rows_matches_reference(rows, dtype, with_out):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    out = torch.empty(rows, 40, dtype=dtype) if with_out else None
    got = linear_rows(x, w, out=out)
    if with_out:
        assert got.data_ptr() == out.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), linear_rows_reference(x, w).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 3, 10], ids=lambda r: f"T{r}")
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
def test_causal_conv_prefill_matches_token_by_token(rows, with_state):
    g = torch.Generator().manual_seed(rows)
    channels, k = 12, 4
    x = torch.randn(rows, channels, generator=g)
    w = torch.randn(channels, k, generator=g)
    state = torch.randn(k - 1, channels, generator=g) if with_state else torch.zeros(k - 1, channels)
    state_ref = state.clone()
    got = causal_conv1d_prefill_(x, w, state)
    want = causal_conv1d_reference(x, w, state_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_ref)


def test_causal_conv_step_shifts_state_in_place():
    from pocketllm.ops.causal_conv import causal_conv1d_step_

    state = torch.arange(6, dtype=torch.float32).view(3, 2)
    ptr = state.data_ptr()
    causal_conv1d_step_(torch.tensor([[10.0, 11.0]]), torch.ones(2, 4), state)
    assert state.data_ptr() == ptr
    assert state.tolist() == [[2.0, 3.0], [4.0, 5.0], [10.0, 11.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norms_match_hf_formulas(dtype):
    from pocketllm.layers.norm import (
        rms_norm_gated,
        rms_norm_gated_reference,
        rms_norm_zero_centred,
        rms_norm_zero_centred_reference,
    )

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(33, 64, generator=g)).to(dtype)
    z = torch.randn(33, 64, generator=g).to(dtype)
    w = (0.2 * torch.randn(64, generator=g)).to(dtype)
    # bf16: one rounding step apart at most.
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(rms_norm_zero_centred(x, w, 1e-6).float(), rms_norm_zero_centred_reference(x, w, 1e-6).float(), **tol)
    torch.testing.assert_close(rms_norm_gated(x, z, 1 + w, 1e-6).float(), rms_norm_gated_reference(x, z, 1 + w, 1e-6).float(), **tol)

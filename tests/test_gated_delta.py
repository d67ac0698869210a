"""The gated delta rule kernels, and the fp32 references the other tests hold kernels to (naive.py),
against a float64 per-token reference (the seam that picks a device kernel: test_gdn_kernels.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pocketllm.ops.gated_delta.chunked as chunked_module
from numerics import assert_close_rel
from pocketllm.bench import gdn_bench
from pocketllm.ops.gated_delta import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_step_torch_,
)
from pocketllm.ops.gated_delta.naive import gated_delta_rule_reference, gated_delta_step_reference_

torch.set_num_threads(min(2, torch.get_num_threads()))


def reference_f64(q, k, v, g, beta, initial_state=None):
    """The recurrence exactly as written, in float64, token by token."""
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    q, k = (x.double().repeat_interleave(Hv // Hk, dim=1) for x in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    S = torch.zeros(Hv, Dk, Dv, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    out = torch.empty(T, Hv, Dv, dtype=torch.float64)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return out, S


def make_inputs(T, Hk, Hv, Dk, Dv, gates="model", seed=0, dtype=torch.float32):
    """gdn-bench's seeded inputs (the model's own gate formula), or with the gates at an extreme:
    "strong" decay (down to exp(-5) a token) or "none"; and a random initial state."""
    q, k, v, g, beta = gdn_bench.make_inputs(T, Hk, Hv, Dk, torch.float32, seed=seed, Dv=Dv)
    gen = torch.Generator().manual_seed(seed + 1)
    if gates == "strong":
        g = -5.0 * torch.rand(T, Hv, generator=gen)
    elif gates == "none":
        g = torch.zeros(T, Hv)
    state = torch.randn(Hv, Dk, Dv, generator=gen) * 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state


CASES = [
    pytest.param(T, Hk, Hk * groups, with_state, id=f"T{T}-Hk{Hk}-Hv{Hk * groups}-{'state' if with_state else 'zero'}")
    for T, Hk in ((1, 2), (63, 2), (64, 2), (65, 2), (1000, 1))
    for groups in (1, 2, 3)
    for with_state in (False, True)
]


@pytest.mark.parametrize("T, Hk, Hv, with_state", CASES)
def test_kernels_match_float64_reference(T, Hk, Hv, with_state):
    Dk, Dv = (16, 8) if T >= 1000 else (32, 16)
    q, k, v, g, beta, state = make_inputs(T, Hk, Hv, Dk, Dv)
    initial = state.clone() if with_state else None
    ref_out, ref_state = reference_f64(q, k, v, g, beta, initial)
    for kernel in (gated_delta_rule_reference, gated_delta_rule_recurrent, gated_delta_rule_chunked):
        out, final = kernel(q, k, v, g, beta, initial)
        assert out.shape == (T, Hv, Dv) and out.dtype == v.dtype
        assert final.shape == (Hv, Dk, Dv) and final.dtype == torch.float32
        assert_close_rel(out, ref_out)
        assert_close_rel(final, ref_state)
    if with_state:
        assert torch.equal(initial, state), "the kernels must not modify initial_state"


@pytest.mark.parametrize("gates", ["strong", "none"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_across_blocks_and_gate_extremes(monkeypatch, gates, chunk_size):
    # Small blocks so the sequence spans several precompute blocks and a ragged last chunk.
    monkeypatch.setattr(chunked_module, "BLOCK_ROWS", 2 * 6 * chunk_size)
    q, k, v, g, beta, state = make_inputs(333, 2, 6, 32, 16, gates=gates)
    ref_out, ref_state = reference_f64(q, k, v, g, beta, state)
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert_close_rel(out, ref_out)
    assert_close_rel(final, ref_state)


@pytest.mark.parametrize("keys", ["identical", "alternating", "near-parallel"])
def test_chunked_where_the_chunk_inverse_is_hardest(keys):
    # The chunk's (I + L)^-1 comes from a decay-free fp32 solve: its entries are largest when
    # keys repeat (|k_t . k_s| = 1) and beta is near 1, with no decay to damp them.
    T, Hk, Hv, D = 200, 1, 2, 16
    q, _, v, _, _, state = make_inputs(T, Hk, Hv, D, D)
    gen = torch.Generator().manual_seed(1)
    k1 = F.normalize(torch.randn(1, Hk, D, generator=gen), dim=-1)
    if keys == "identical":
        k = k1.expand(T, Hk, D).contiguous()
    elif keys == "alternating":
        k = (k1 * torch.tensor([1.0, -1.0]).repeat(T // 2)[:, None, None]).contiguous()
    else:
        k = F.normalize(k1 + 0.05 * torch.randn(T, Hk, D, generator=gen), dim=-1)
    g, beta = torch.zeros(T, Hv), torch.full((T, Hv), 0.999)
    ref_out, ref_state = reference_f64(q, k, v, g, beta, state)
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, state)
    assert_close_rel(out, ref_out)
    assert_close_rel(final, ref_state)


@pytest.mark.parametrize("chunk_size", [32, 64])
@pytest.mark.parametrize("T", [31, 32, 33, 63, 64, 65, 129])
def test_chunked_at_chunk_boundaries(T, chunk_size):
    q, k, v, g, beta, state = make_inputs(T, 2, 6, 16, 8)
    ref_out, ref_state = reference_f64(q, k, v, g, beta, state)
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert_close_rel(out, ref_out)
    assert_close_rel(final, ref_state)


def test_strided_inputs_as_the_layer_passes_them():
    # The layer splits one projection into q, k, v views: rows are not contiguous.
    T, Hk, Hv, Dk, Dv = 100, 2, 4, 16, 8
    q, k, v, g, beta, state = make_inputs(T, Hk, Hv, Dk, Dv)
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs, ks, vs = mixed.split((Hk * Dk, Hk * Dk, Hv * Dv), dim=1)
    qs, ks, vs = qs.view(T, Hk, Dk), ks.view(T, Hk, Dk), vs.view(T, Hv, Dv)
    assert not qs.is_contiguous()
    ref_out, ref_state = reference_f64(q, k, v, g, beta, state)
    for kernel in (gated_delta_rule_reference, gated_delta_rule_recurrent, gated_delta_rule_chunked):
        out, final = kernel(qs, ks, vs, g, beta, state)
        assert_close_rel(out, ref_out)
        assert_close_rel(final, ref_state)
    S = state.clone()
    out = gated_delta_step_torch_(qs[:1], ks[:1], vs[:1], g[:1], beta[:1], S)
    assert_close_rel(out[0], reference_f64(q[:1], k[:1], v[:1], g[:1], beta[:1], state)[0][0])


def test_step_updates_state_in_place_and_matches_recurrence():
    q, k, v, g, beta, state = make_inputs(20, 2, 6, 32, 16)
    ref_out, ref_state = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    S = state.clone()
    ptr = S.data_ptr()
    for t in range(20):
        out = gated_delta_step_torch_(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], S)
        assert out.shape == (1, 6, 16) and out.dtype == torch.float32
        assert_close_rel(out[0], ref_out[t], tol=1e-6)
    assert S.data_ptr() == ptr
    assert_close_rel(S, ref_state, tol=1e-6)


def test_bf16_inputs_keep_fp32_state():
    q, k, v, g, beta, state = make_inputs(70, 2, 4, 32, 16, dtype=torch.bfloat16)
    ref_out, ref_state = reference_f64(q, k, v, g, beta, state)
    for kernel in (gated_delta_rule_reference, gated_delta_rule_recurrent, gated_delta_rule_chunked):
        out, final = kernel(q, k, v, g, beta, state)
        assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
        assert_close_rel(out.float(), ref_out, tol=1e-2)
        assert_close_rel(final, ref_state)
    S = state.clone()
    out = gated_delta_step_torch_(q[:1], k[:1], v[:1], g[:1], beta[:1], S)
    # The step returns its fp32 result unrounded; the layer rounds it to the model dtype.
    assert out.shape == (1, 4, 16) and out.dtype == torch.float32 and S.dtype == torch.float32
    assert_close_rel(out[0], ref_out[0], tol=1e-2)


def test_step_rejects_non_fp32_state():
    q, k, v, g, beta, state = make_inputs(1, 1, 2, 8, 8)
    for step in (gated_delta_step_torch_, gated_delta_step_reference_):
        with pytest.raises(ValueError, match="float32"):
            step(q, k, v, g, beta, state.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_step_matches_the_plain_reference_step(dtype):
    q, k, v, g, beta, state = make_inputs(20, 2, 6, 32, 16, dtype=dtype)
    mine, ref = state.clone(), state.clone()
    for t in range(20):
        s = slice(t, t + 1)
        out = gated_delta_step_torch_(q[s], k[s], v[s], g[s], beta[s], mine)
        want = gated_delta_step_reference_(q[s], k[s], v[s], g[s], beta[s], ref)
        assert out.dtype == want.dtype == torch.float32 and out.shape == want.shape == (1, 6, 16)
        assert_close_rel(out, want, tol=1e-5)
    assert_close_rel(mine, ref, tol=1e-5)


def test_chunked_matches_transformers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # the test extra installs it
    q, k, v, g, beta, state = make_inputs(150, 2, 6, 32, 32)
    # transformers scales q by Dk**-0.5 itself and takes [B, T, H, D].
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(
        (q * 32**0.5)[None], k[None], v[None], g=g[None], beta=beta[None],
        initial_state=state[None], output_final_state=True,
    )
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, state)
    assert_close_rel(out, hf_out[0])
    assert_close_rel(final, hf_state[0])

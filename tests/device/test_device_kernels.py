"""The gated delta rule kernels on the device at the model's shapes: the device kernel (fla on
CUDA, torch_npu's op on Ascend) and the torch chunked kernel against the per-token recurrence run
on the same device in fp32 (the plain reference, ops/gated_delta/naive.py)."""

from __future__ import annotations

import pytest
import torch

from device_caps import fla_installed, npu_op_present, on_devices
from pocketllm.bench.gdn_bench import make_inputs
from pocketllm.ops.gated_delta import gated_delta_rule_chunked
from pocketllm.ops.gated_delta.naive import gated_delta_rule_reference, gated_delta_step_reference_
from pocketllm.ops.gated_delta.backends import select_gdn_kernel

# One rank's GDN heads of the 27B model at TP=1 and TP=4, head dim 128 (design.md section 1).
SHAPES = [pytest.param(16, 48, id="Hk16-Hv48"), pytest.param(4, 12, id="Hk4-Hv12")]
LENGTHS = [pytest.param(T, id=f"T{T}") for T in (1, 63, 64, 65, 1000)]


def _worst(x, ref) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(kind, T, Hk, Hv, dtype, seed=0):
    q, k, v, g, beta = (x.to(kind) for x in make_inputs(T, Hk, Hv, 128, dtype, seed=seed))
    state = (torch.randn(Hv, 128, 128, generator=torch.Generator().manual_seed(seed + 1)) * 0.1).to(kind)
    return q.float(), k.float(), v, g, beta.float(), state


def _device_kernel(kind):
    kernel = select_gdn_kernel(torch.device(kind, 0), torch.bfloat16, env={})
    have = fla_installed() if kind == "cuda" else npu_op_present()
    if not have:
        pytest.skip(f"no device kernel installed for {kind} ({'fla' if kind == 'cuda' else 'torch_npu.npu_chunk_gated_delta_rule'})")
    assert kernel.name in ("fla", "npu"), f"the device kernel failed its probe: {kernel.describe()}"
    return kernel


@on_devices()
@pytest.mark.parametrize("Hk, Hv", SHAPES)
@pytest.mark.parametrize("T", LENGTHS)
def test_device_kernel_prefill_matches_the_recurrence_and_the_chunked_kernel(kind, Hk, Hv, T):
    kernel = _device_kernel(kind)
    q, k, v, g, beta, state = _inputs(kind, T, Hk, Hv, torch.bfloat16)
    out, final = kernel.prefill(q, k, v, g, beta, state)
    ref_out, ref_final = gated_delta_rule_reference(q, k, v.float(), g, beta, state)
    chunk_out, chunk_final = gated_delta_rule_chunked(q, k, v.float(), g, beta, state)
    assert final.dtype == torch.float32 and final.shape == state.shape
    for name, err in {"out vs recurrence": _worst(out, ref_out), "state vs recurrence": _worst(final, ref_final),
                      "out vs chunked": _worst(out, chunk_out), "state vs chunked": _worst(final, chunk_final)}.items():
        assert err < 3e-2, f"{kernel.name} {name}: {err:.2e}"


@on_devices()
@pytest.mark.parametrize("Hk, Hv", SHAPES)
def test_device_kernel_decode_advances_the_state_like_the_step(kind, Hk, Hv):
    kernel = _device_kernel(kind)
    q, k, v, g, beta, state = _inputs(kind, 8, Hk, Hv, torch.bfloat16)
    mine, ref = state.clone(), state.clone()
    for t in range(8):
        s = slice(t, t + 1)
        out = kernel.decode_step_(q[s], k[s], v[s], g[s], beta[s], mine)
        ref_out = gated_delta_step_reference_(q[s], k[s], v[s].float(), g[s], beta[s], ref)
        assert _worst(out, ref_out) < 3e-2, t
    assert _worst(mine, ref) < 3e-2


@on_devices()
@pytest.mark.parametrize("Hk, Hv", SHAPES)
def test_torch_chunked_kernel_on_the_device_matches_the_recurrence_in_fp32(kind, Hk, Hv):
    q, k, v, g, beta, state = _inputs(kind, 1000, Hk, Hv, torch.float32)
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, state)
    ref_out, ref_final = gated_delta_rule_reference(q, k, v, g, beta, state)
    assert _worst(out, ref_out) < 1e-3 and _worst(final, ref_final) < 1e-3


@on_devices()
def test_the_engine_never_picks_a_device_kernel_for_float32(kind):
    assert select_gdn_kernel(torch.device(kind, 0), torch.float32, env={}).name == "chunk"

"""The gated delta rule through torch_npu's `npu_chunk_gated_delta_rule` (the CANN op
aclnnChunkGatedDeltaRule), for prefill on Ascend; decode keeps the torch step.

The schema, as torch_npu registers it (op-plugin's ChunkGatedDeltaRuleKernelNpuOpApi.cpp and its
graph converter): `npu_chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, *, Tensor?
beta=None, Tensor? initial_state=None, Tensor? actual_seq_lengths=None, float? scale=None,
Tensor? g=None) -> (Tensor, Tensor)`: packed [T, N, D] query/key (key heads) and value, beta [T,
Nv], g [T, Nv] fp32, initial_state value-major [B, Nv, Dv, Dk], actual_seq_lengths [B] int32; the
output is allocated bf16 and the final state is a clone of initial_state, so it keeps that dtype.

Stance on devices: the op is documented for Atlas A2/A3 (910B/910C) and bf16 only. On a 910A (the
seed's machine) it is absent or fails its probe, and the torch chunked kernel runs instead. fla's
own Ascend path (fla-core 0.6.0's `npu` extra, triton-ascend) runs fla's chunk_gated_delta_rule
on an NPU, but pins torch 2.10.0 and torch_npu 2.10.0.post7 exactly, so it is used only when forced
(POCKETLLM_GDN_KERNEL=fla) where that stack is installed.
"""

from __future__ import annotations

import torch


def _op():
    import torch_npu

    return torch_npu.npu_chunk_gated_delta_rule


def npu_prefill(q, k, v, g, beta, initial_state=None, state_dtype: torch.dtype = torch.float32):
    """Same contract as gated_delta_rule_chunked. `state_dtype` is the state the op is given: the
    probe (backends._npu_kernel) picks fp32 when the op takes it, so the fp32 state is
    not rounded on the way in; where only bf16 is accepted, it is rounded once per prefill."""
    op = _op()
    T, Hv, Dv = v.shape
    Dk = k.shape[-1]
    low = torch.bfloat16
    if initial_state is None:
        state = torch.zeros(1, Hv, Dv, Dk, dtype=state_dtype, device=v.device)
    else:
        state = initial_state.transpose(-1, -2)[None].to(state_dtype).contiguous()
    out, final = op(
        q.to(low),
        k.to(low),
        v.to(low),
        beta=beta.to(low),
        initial_state=state,
        actual_seq_lengths=torch.tensor([T], dtype=torch.int32, device=v.device),
        scale=1.0,
        g=g.float(),
    )
    return out.to(v.dtype), final[0].transpose(-1, -2).float().contiguous()

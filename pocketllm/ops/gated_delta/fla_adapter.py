"""The gated delta rule through flash-linear-attention (fla), on CUDA: our [T, H, D] one-sequence
convention against fla's batched [B, T, H, D] one.

Written against fla-core 0.6.0 (pinned in the `cuda` extra): `chunk_gated_delta_rule(q, k, v, g,
beta, scale=None, initial_state=None, output_final_state=False, ...)` and
`fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
initial_state=None, output_final_state=False, ...)`, both in fla/ops/gated_delta_rule/. Every
argument after v goes by keyword: in the recurrent form the fifth slot is `gk`, not `beta`.
"""

from __future__ import annotations

import os

# Triton's switch that keeps autotuning timings on disk (beside its compiled kernels).
AUTOTUNING_CACHE = "TRITON_CACHE_AUTOTUNING"


def _ops():
    # fla autotunes its kernels in each process that first calls them, which is seconds of every
    # start; Triton keeps the timings on disk only when asked, so a second start reads them. Its
    # autotuners read the switch when fla is imported; one the user set is left as it is.
    os.environ.setdefault(AUTOTUNING_CACHE, "1")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _batched(q, k, v, g, beta):
    # fla handles more value heads than key heads itself (GVA when HV > H, since 0.6.0's
    # signatures), so q and k stay at key heads, in v's dtype: no fp32 value-head copies.
    return q.to(v.dtype)[None], k.to(v.dtype)[None], v[None], g.float()[None], beta.to(v.dtype)[None]


def fla_prefill(q, k, v, g, beta, initial_state=None):
    """Same contract as gated_delta_rule_chunked: (out [T, Hv, Dv] in v's dtype, final_state
    [Hv, Dk, Dv] fp32)."""
    chunk, _ = _ops()
    qb, kb, vb, gb, bb = _batched(q, k, v, g, beta)
    # fla's state is [N, HV, K, V] fp32, ours [Hv, Dk, Dv] fp32: a batch dim, no copy. q is
    # already scaled by Dk**-0.5, hence scale=1.
    state = None if initial_state is None else initial_state[None]
    out, final = chunk(
        qb, kb, vb, g=gb, beta=bb, scale=1.0, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    return out[0].to(v.dtype), final[0].float()


def fla_decode_step_(q, k, v, g, beta, state):
    """Same contract as gated_delta_step_torch_: out [1, Hv, Dv], `state` advanced in place."""
    _, recurrent = _ops()
    qb, kb, vb, gb, bb = _batched(q, k, v, g, beta)
    out, final = recurrent(
        qb, kb, vb, g=gb, beta=bb, scale=1.0, initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    # fla returns the new state rather than updating it; the caller owns `state`.
    state.copy_(final[0])
    return out[0]


def fla_decode_rows_(q, k, v, g, beta, state):
    """Same contract as gated_delta_rows_torch_: one token of each of B sequences (fla's batch is
    the sequences, each one token long), out [B, Hv, Dv], `state` [B, Hv, Dk, Dv] advanced in place."""
    _, recurrent = _ops()
    out, final = recurrent(
        q.to(v.dtype)[:, None], k.to(v.dtype)[:, None], v[:, None], g=g.float()[:, None], beta=beta.to(v.dtype)[:, None],
        scale=1.0, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False,
    )
    state.copy_(final)
    return out[:, 0]

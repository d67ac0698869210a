"""The gated delta rule through flash-linear-attention (fla), on CUDA: our [T, H, D] one-sequence
convention against fla's batched [B, T, H, D] one.

Written against fla-core 0.6.0 (pinned in the `cuda` extra): `chunk_gated_delta_rule(q, k, v, g,
beta, scale=None, initial_state=None, output_final_state=False, ...)` and
`fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
initial_state=None, output_final_state=False, ...)`, both in fla/ops/gated_delta_rule/. Every
argument after v goes by keyword: in the recurrent form the fifth slot is `gk`, not `beta`.
"""

from __future__ import annotations

import torch

# fla's chunked kernels are autotuned on their heads, head dims and dtypes, not on the sequence's
# length, and the timings are kept for the process and on disk for every later one (fla 0.6.0
# asks Triton to, FLA_CACHE_RESULTS=1 by default, so a second start reads them): the first call
# at a head layout picks the configs every length runs there from then on. A first call of a few
# rows (a server's warm-up, a short first prompt) is all launch cost, so its timings rank the
# configs at random; the first call at each layout is preceded by one of TUNE_ROWS rows, a prompt
# long enough for the timings to rank the configs as long prompts run them.
TUNE_ROWS = 4096
_tuned: set[tuple] = set()


def _ops():
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
    _tune_once(chunk, qb, kb, vb, gb, bb, state)
    out, final = chunk(
        qb, kb, vb, g=gb, beta=bb, scale=1.0, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    return out[0].to(v.dtype), final[0].float()


def _tune_once(chunk, qb, kb, vb, gb, bb, state) -> None:
    """Before the first call at a layout (see TUNE_ROWS), one at TUNE_ROWS rows of zeros with the
    same heads, dims, dtypes and state argument: the autotuners' key, and their timings at a length
    that ranks the configs as a long prompt runs them."""
    layout = tuple((tuple(x.shape[2:]), x.dtype, x.device) for x in (qb, vb, gb, bb)) + (state is None,)
    if layout in _tuned:
        return
    _tuned.add(layout)
    if qb.shape[1] >= TUNE_ROWS:
        return  # the call itself is long enough
    rows = lambda x: x.new_zeros((1, TUNE_ROWS, *x.shape[2:]))  # noqa: E731
    try:
        chunk(rows(qb), rows(kb), rows(vb), g=rows(gb), beta=rows(bb), scale=1.0,
              initial_state=None if state is None else torch.zeros_like(state), output_final_state=True, use_qk_l2norm_in_kernel=False)
    except Exception:  # noqa: BLE001  (a speed aid: one that cannot run, out of memory say, leaves the call to tune itself)
        pass


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

"""The gated delta rule as written, token by token in fp32: the references the tests hold every
kernel to (the torch forms in recurrent.py and chunked.py, the compiled decode block, the device
adapters), each with the signature of the kernel it stands for. Nothing outside the tests runs
them: speeding up a kernel never moves what it is compared against.

Shapes are one sequence, no batch dim: q, k [T, Hk, Dk] (already l2-normalised, q already scaled
by Dk**-0.5), v [T, Hv, Dv], g (log decay, <= 0) and beta [T, Hv], state [Hv, Dk, Dv] fp32.
Value head j reads key head j // (Hv // Hk). Per value head, in fp32:
    S = S * exp(g_t);  delta = beta_t * (v_t - k_t^T S);  S = S + k_t (x) delta;  o_t = q_t^T S
"""

from __future__ import annotations

import torch

from pocketllm.ops.gated_delta.recurrent import check_shapes


def _token(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence as written: q, k [Hk, Dk], v [Hv, Dv], g, beta [Hv], state
    [Hv, Dk, Dv] fp32 -> (o [Hv, Dv], the new state), both fp32."""
    groups = v.shape[0] // k.shape[0]
    q, k = (x.float().repeat_interleave(groups, dim=0) for x in (q, k))
    state = state * g.float().exp()[:, None, None]
    delta = beta.float()[:, None] * (v.float() - torch.einsum("hk,hkv->hv", k, state))
    state = state + k[:, :, None] * delta[:, None, :]
    return torch.einsum("hk,hkv->hv", q, state), state


def gated_delta_rule_reference(q, k, v, g, beta, initial_state=None):
    """The whole sequence one token at a time. Returns (out [T, Hv, Dv] in v's dtype,
    final_state [Hv, Dk, Dv] fp32); initial_state is not modified."""
    T, _, Hv, Dk, Dv = check_shapes(q, k, v, g, beta, initial_state)
    state = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device) if initial_state is None else initial_state.float().clone()
    out = torch.empty(T, Hv, Dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        out[t], state = _token(q[t], k[t], v[t], g[t], beta[t], state)
    return out.to(v.dtype), state


def gated_delta_step_reference_(q, k, v, g, beta, state) -> torch.Tensor:
    """One token (T = 1): `state` ([Hv, Dk, Dv] fp32) advanced in place; returns out [1, Hv, Dv]
    in fp32."""
    T = check_shapes(q, k, v, g, beta, state)[0]
    if T != 1:
        raise ValueError(f"gated_delta_step_reference_ takes one token; got T={T}")
    if state.dtype != torch.float32:
        raise ValueError(f"state must be float32; got {state.dtype}")
    out, new_state = _token(q[0], k[0], v[0], g[0], beta[0], state)
    state.copy_(new_state)
    return out[None]

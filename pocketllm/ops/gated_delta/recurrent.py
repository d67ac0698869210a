"""The gated delta rule token by token in torch: the decode step every torch path runs (one token,
state updated in place; the compiled decode block takes its place for bf16 on a CPU), and the
per-token prefill (POCKETLLM_GDN_KERNEL=recurrent) a device kernel's probe is held to. The plain
references the tests hold these to are in naive.py.

Shapes are one sequence, no batch dim: q, k [T, Hk, Dk] (already l2-normalised, q already scaled
by Dk**-0.5), v [T, Hv, Dv], g (log decay, <= 0) and beta [T, Hv], state [Hv, Dk, Dv] fp32.
Value head j reads key head j // (Hv // Hk). Per value head, in fp32:
    S = S * exp(g_t);  delta = beta_t * (v_t - k_t^T S);  S = S + k_t (x) delta;  o_t = q_t^T S
"""

from __future__ import annotations

import torch


def check_shapes(q, k, v, g, beta, state=None) -> tuple[int, int, int, int, int]:
    """Validate one sequence's inputs; return (T, Hk, Hv, Dk, Dv)."""
    if k.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk]; got {tuple(q.shape)} and {tuple(k.shape)}")
    T, Hk, Dk = k.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"v must be [T={T}, Hv, Dv]; got {tuple(v.shape)}")
    Hv, Dv = v.shape[1], v.shape[2]
    if Hv % Hk != 0:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (T, Hv):
            raise ValueError(f"{name} must be [T={T}, Hv={Hv}]; got {tuple(x.shape)}")
    if state is not None and tuple(state.shape) != (Hv, Dk, Dv):
        raise ValueError(f"state must be [Hv={Hv}, Dk={Dk}, Dv={Dv}]; got {tuple(state.shape)}")
    return T, Hk, Hv, Dk, Dv


def expand_to_value_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hv, D] with consecutive value heads sharing a key head, in fp32."""
    groups = value_heads // x.shape[-2]
    x = x.float()
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=-2)


def _step_f32(q, k, v, decay, beta, state, out, kv_mem) -> None:
    """One token on prepared fp32 rows: q, k [Hv, Dk], v, out [Hv, Dv], decay, beta [Hv]."""
    state.mul_(decay[:, None, None])
    # k^T S for every head as one small bmm, into a reused [Hv, 1, Dv] buffer.
    torch.bmm(k[:, None, :], state, out=kv_mem)
    delta = torch.sub(v, kv_mem[:, 0], out=kv_mem[:, 0])  # [Hv, Dv]
    delta.mul_(beta[:, None])
    # The rank-1 update S += k (x) delta, in place: no state-sized temporary.
    state.baddbmm_(k[:, :, None], delta[:, None, :])
    torch.bmm(q[:, None, :], state, out=out[:, None, :])


def gated_delta_step_torch_(q, k, v, g, beta, state) -> torch.Tensor:
    """Advance `state` ([Hv, Dk, Dv] fp32) by one token in place; return out [1, Hv, Dv] in fp32.
    The caller rounds to its own dtype: an fp32 result is not copied into a v-dtype buffer only to
    be converted again. One sequence's case of gated_delta_rows_torch_."""
    T, _, Hv, Dk, Dv = check_shapes(q, k, v, g, beta, state)
    if T != 1:
        raise ValueError(f"gated_delta_step_torch_ takes one token; got T={T}")
    if state.dtype != torch.float32:
        raise ValueError(f"state must be float32; got {state.dtype}")
    return gated_delta_rows_torch_(q, k, v, g, beta, state[None])


def gated_delta_rows_torch_(q, k, v, g, beta, state) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], state
    [B, Hv, Dk, Dv] fp32, advanced in place; out [B, Hv, Dv] fp32. No branch on the data and
    nothing sized by it: a captured decode step runs it as it is.

    The same arithmetic as the recurrence, reordered so the state is read once before it is
    updated: with S' = decay S + k (x) delta, k^T (decay S) = decay k^T S and q^T S' = decay q^T S
    + (q . k) delta, so k^T S and q^T S come from one batched product on the old state, where the
    recurrence reads the state twice more. The update is torch's scale in place and its rank-1
    update in place (torch has no one op for the two; the compiled decode block does both in one
    pass). Each sequence's rows are the same ops on the same shapes whatever B is."""
    b, hv, dk, dv = state.shape
    q_v = expand_to_value_heads(q, hv).reshape(b * hv, dk)
    k_v = expand_to_value_heads(k, hv).reshape(b * hv, dk)
    flat = state.view(b * hv, dk, dv)
    decay = g.float().exp().reshape(b * hv, 1)
    ks, qs = torch.bmm(torch.stack((k_v, q_v), dim=1), flat).unbind(1)  # [B*Hv, Dv] each
    delta = (v.float().reshape(b * hv, dv) - decay * ks).mul_(beta.float().reshape(b * hv, 1))
    out = (decay * qs).addcmul_((q_v * k_v).sum(-1, keepdim=True), delta)
    flat.mul_(decay[:, :, None]).baddbmm_(k_v[:, :, None], delta[:, None, :])
    return out.view(b, hv, dv)


def gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None):
    """The whole sequence one token at a time. Returns (out [T, Hv, Dv] in v's dtype,
    final_state [Hv, Dk, Dv] fp32)."""
    T, _, Hv, Dk, Dv = check_shapes(q, k, v, g, beta, initial_state)
    if initial_state is None:
        state = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.to(dtype=torch.float32, copy=True)
    # Convert and expand once for the whole sequence so the per-token loop only does the math.
    q_v = expand_to_value_heads(q, Hv)  # [T, Hv, Dk]
    k_v = expand_to_value_heads(k, Hv)  # [T, Hv, Dk]
    v_f = v.float()  # [T, Hv, Dv]
    decay = g.float().exp()  # [T, Hv]
    beta_f = beta.float()  # [T, Hv]
    out = torch.empty(T, Hv, Dv, dtype=torch.float32, device=v.device)
    kv_mem = state.new_empty(Hv, 1, Dv)
    for t in range(T):
        _step_f32(q_v[t], k_v[t], v_f[t], decay[t], beta_f[t], state, out[t], kv_mem)
    return out.to(v.dtype), state

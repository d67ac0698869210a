"""Plain references for the fused decode calls, with the same signatures: what pocketllm.ops.fused's
compiled calls and the torch forms (torch_forms.py) must equal up to fp32 summation order. Only the
tests run them. The layers' own paths (GatedDeltaNet.forward, GatedAttention.forward) do the same
work for any number of rows; the Gated DeltaNet and attention references here are that work
written out for one row, plainly, so a test can hold the compiled calls and the layers' paths to
them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops.causal_conv import causal_conv1d_step_
from pocketllm.ops.gated_delta.naive import gated_delta_step_reference_
from pocketllm.ops.norms import l2_normalize, rms_norm_gated, rms_norm_scaled


def add_rms_norm_reference(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + x, rms_norm(h + x) * scale) for rows h, x [T, n]; x None means no add. The norm in
    fp32, rounded once to h's dtype."""
    if x is not None:
        h = h + x
    return h, F.rms_norm(h.float(), (h.shape[-1],), scale, eps).to(h.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gdn_decode_reference(proj, taps, conv_state, neg_a, dt_bias, norm_w, eps: float, state, hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    """The Gated DeltaNet block of one row: proj [1, conv | z | b | a] -> [1, hv*dv], advancing
    conv_state and the fp32 state in place."""
    conv = 2 * hk * dk + hv * dv
    mixed, z, b, a = proj.reshape(1, -1).split([conv, hv * dv, hv, hv], dim=-1)
    mixed = causal_conv1d_step_(mixed, taps, conv_state)
    qk, v = mixed.split((2 * hk * dk, hv * dv), dim=-1)
    qk = l2_normalize(qk.view(1, 2 * hk, dk))
    q, k = qk[:, :hk] * dk**-0.5, qk[:, hk:]
    beta = torch.sigmoid(b).float()
    g = neg_a * F.softplus(a.float() + dt_bias)
    out = gated_delta_step_reference_(q, k, v.view(1, hv, dv), g, beta, state)
    return rms_norm_gated(out.to(proj.dtype), z.view(1, hv, dv), norm_w, eps).reshape(1, hv * dv)


def gdn_decode_rows_reference(proj, taps, conv_states, neg_a, dt_bias, norm_w, eps: float, states, hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    """The block for several sequences' decode rows: proj [B, in] -> [B, hv*dv], row r advancing
    conv_states[r] and states[r]."""
    return torch.cat([
        gdn_decode_reference(proj[r : r + 1], taps, c, neg_a, dt_bias, norm_w, eps, st, hk, hv, dk, dv)
        for r, (c, st) in enumerate(zip(conv_states, states))
    ])


def attention_decode_reference(qkv, q_scale, k_scale, eps: float, cos, sin, k_pool, v_pool, table, pos: int, heads: int, kv_heads: int,
                               head_dim: int, scale: float) -> torch.Tensor:
    """Gated attention of one row at position pos: qkv [1, H*2d (query and gate interleaved per
    head) | Hkv*d | Hkv*d] -> [1, H*d]. q and k normed and rotated in their dtype, row pos of the
    sequence's blocks written (k_pool, v_pool [blocks, Hkv, block_size, d], table: its block
    ids), softmax attention in fp32 over positions 0..pos read through the table, then the
    output gate."""
    d = head_dim
    q_gate, k, v = qkv.reshape(-1).split([heads * 2 * d, kv_heads * d, kv_heads * d])
    q_gate = q_gate.view(1, heads, 2 * d)
    q = _rotated(rms_norm_scaled(q_gate[0, :, :d], q_scale, eps), cos, sin)  # [H, d]
    k = _rotated(rms_norm_scaled(k.view(kv_heads, d), k_scale, eps), cos, sin)  # [Hkv, d]
    bs = k_pool.shape[2]
    block = int(table[pos // bs])
    k_pool[block, :, pos % bs] = k
    v_pool[block, :, pos % bs] = v.view(kv_heads, d)
    positions = torch.arange(pos + 1, device=qkv.device)
    ids = table[positions // bs].long()
    keys = k_pool[ids, :, positions % bs].float()  # [S, Hkv, d]
    values = v_pool[ids, :, positions % bs].float()
    scores = torch.einsum("hgd,shd->hgs", q.float().view(kv_heads, heads // kv_heads, d), keys) * scale
    out = torch.einsum("hgs,shd->hgd", torch.softmax(scores, dim=-1), values).reshape(1, heads * d)
    return out.to(qkv.dtype) * torch.sigmoid(q_gate[..., d:].reshape(1, heads * d))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, d] with its first 2 * half dims rotated as two halves (NeoX) in fp32, in x's dtype."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[:, :half], xf[:, half : 2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[:, 2 * half :]), dim=-1).to(x.dtype)

"""The torch forms of the device prefill kernels (kernels/), with the kernels' signatures: what the
custom ops run off CUDA, and what the tests hold the kernels to. Where the layers already have the
form in ops/ it is that form; rope and the KV write are the layers' own arithmetic written again
on plain tensors here, since ops/ does not import layers/ (tests/test_device_ops.py checks they
equal layers.rotary.apply_rotary and layers.paged_attention.write_kv bit for bit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.ops.causal_conv import causal_conv1d_prefill_
from pocketllm.ops.fused.torch_forms import add_rms_norm_torch, silu_mul_torch
from pocketllm.ops.norms import l2_normalize, rms_norm_gated, rms_norm_scaled


def qk_l2_norm_torch(qk: torch.Tensor, heads_q: int, q_scale: float, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """qk [T, Hq + Hk, dk] -> q [T, Hq, dk] unit length times q_scale, k [T, Hk, dk] unit length,
    fp32 (the GDN layer's q and k for the gated delta rule)."""
    qk = l2_normalize(qk, eps)
    return qk[:, :heads_q] * q_scale, qk[:, heads_q:]


def gdn_gates_torch(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv]; neg_a [Hv] fp32 (-exp(A_log)); dt_bias [Hv] -> (g, beta) [T, Hv] fp32."""
    beta = torch.sigmoid(b).float()
    g = neg_a * F.softplus(a.float() + dt_bias)
    return g, beta


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, rd/2]. Rotates the first rd dims as two halves in fp32, returns
    x's dtype (layers.rotary.apply_rotary)."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, xf[..., 2 * half :]), dim=-1)
    return rotated.to(x.dtype)


def write_kv_torch(k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Keys and values [T, Hkv, D] of positions start..start+T-1 into the pools [blocks, Hkv,
    block_size, D] at the blocks `table` lists (layers.paged_attention.write_kv)."""
    heads, bs, d = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    pos = torch.arange(start, start + k.shape[0], device=table.device)
    head0 = table[pos // bs].long() * (heads * bs) + pos % bs
    rows = head0[None, :] + bs * torch.arange(heads, device=table.device)[:, None]  # [Hkv, T]
    k_pool.view(-1, d)[rows] = k.transpose(0, 1)
    v_pool.view(-1, d)[rows] = v.transpose(0, 1)


__all__ = [
    "add_rms_norm_torch", "apply_rotary_torch", "causal_conv1d_prefill_", "gdn_gates_torch", "qk_l2_norm_torch",
    "rms_norm_gated", "rms_norm_scaled", "silu_mul_torch", "write_kv_torch",
]

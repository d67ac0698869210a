"""Gated full attention: query and gate interleaved per head in q_proj, q/k norm, partial RoPE,
causal GQA over the sequence's KV blocks (layers/cache.py), out * sigmoid(gate), row-parallel
o_proj."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.config import FULL, ModelConfig
from pocketllm.distributed.state import tp
from pocketllm.layers.cache import KV_BLOCK_SIZE, KVPool, PagedKV
from pocketllm.layers.context import ForwardContext, Segment, per_sequence
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.rotary import apply_rotary
from pocketllm.ops.fused import decode_ops
from pocketllm.profiling.scopes import scope


def kv_head_range(num_kv: int, rank: int, world: int) -> tuple[int, int]:
    """KV heads this rank holds. With fewer KV heads than ranks each head is replicated on
    world // num_kv consecutive ranks, which are exactly the ranks whose query heads read it."""
    if num_kv >= world:
        per = num_kv // world
        return rank * per, (rank + 1) * per
    head = rank // (world // num_kv)
    return head, head + 1


def kv_block_bytes(cfg: ModelConfig, world: int, elem_size: int, block_size: int = KV_BLOCK_SIZE) -> int:
    """Bytes one KV block takes on each rank, K and V of every full-attention layer."""
    kv0, kv1 = kv_head_range(cfg.num_key_value_heads, 0, world)
    layers = sum(1 for t in cfg.layer_types if t == FULL)
    return 2 * layers * (kv1 - kv0) * block_size * cfg.head_dim * elem_size


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype, device):
        super().__init__()
        rank, world = tp().rank, tp().world
        d, hidden = cfg.head_dim, cfg.hidden_size
        self.head_dim = d
        self.heads = cfg.num_attention_heads // world
        kv0, kv1 = kv_head_range(cfg.num_key_value_heads, rank, world)
        self.kv_heads = kv1 - kv0
        q_rows = cfg.num_attention_heads * d * 2
        kv_rows = cfg.num_key_value_heads * d
        q_per_rank = self.heads * d * 2
        self.qkv_proj = ColumnParallelLinear(
            hidden,
            [
                (f"{prefix}.q_proj.weight", (q_rows, hidden), [(rank * q_per_rank, (rank + 1) * q_per_rank)]),
                (f"{prefix}.k_proj.weight", (kv_rows, hidden), [(kv0 * d, kv1 * d)]),
                (f"{prefix}.v_proj.weight", (kv_rows, hidden), [(kv0 * d, kv1 * d)]),
            ],
            dtype,
            device,
            cfg.weights,
        )
        self.q_norm = RMSNorm(f"{prefix}.q_norm.weight", d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(f"{prefix}.k_norm.weight", d, cfg.rms_norm_eps, dtype, device)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj.weight", cfg.num_attention_heads * d, hidden, "full.out", dtype, device, cfg.weights)
        self.scale = d**-0.5
        self._dtype, self._device = dtype, device
        self.compiled_decode = decode_ops(dtype, torch.device(device)).attention_decode

    def allocate_pool(self, num_blocks: int, block_size: int = KV_BLOCK_SIZE) -> KVPool:
        shape = (num_blocks, self.kv_heads, block_size, self.head_dim)
        return KVPool(torch.zeros(shape, dtype=self._dtype, device=self._device), torch.zeros(shape, dtype=self._dtype, device=self._device))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cache) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `cache` holds this layer's PagedKV of each sequence of
        the pass (ctx.segments)."""
        with scope("projections", "full.in"):
            qkv = self.qkv_proj(x, ctx)
        return self.o_proj(per_sequence(self._attend, qkv, ctx, cache), ctx)

    def _attend(self, qkv: torch.Tensor, seq: Segment, kv: PagedKV) -> torch.Tensor:
        """One sequence's projected rows [T, q+k+v local] -> the gated output [T, heads*D],
        writing its keys and values into its blocks."""
        t, d = qkv.shape[0], self.head_dim
        if seq.one_row and self.compiled_decode is not None:
            # One call from the q/k norms to the output gate: the same as the path below (the
            # tests compare them) up to fp32 summation order.
            with scope("attention_decode"):
                return self.compiled_decode(
                    qkv, self.q_norm.scale, self.k_norm.scale, self.q_norm.eps, seq.cos[0], seq.sin[0], kv.pool.k, kv.pool.v,
                    kv.table.ids, seq.start, self.heads, self.kv_heads, d, self.scale,
                )
        q_gate, k, v = qkv.split(self.qkv_proj.part_sizes, dim=-1)
        q_gate = q_gate.view(t, self.heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:].reshape(t, self.heads * d)
        with scope("norms", "qk"):
            q = self.q_norm(q)  # [T, H, D]
            k = self.k_norm(k.view(t, self.kv_heads, d))
        with scope("rope"):
            q = apply_rotary(q, seq.cos, seq.sin)
            k = apply_rotary(k, seq.cos, seq.sin)
        end = seq.start + t
        with scope("kv_write"):
            write_kv(kv, seq.start, k, v.view(t, self.kv_heads, d))
        with scope("full_attention"):
            keys, values = gather_kv(kv, end)
            out = attention_core(q.transpose(0, 1), keys, values, seq.start, self.scale)
        with scope("gates", "full"):
            return out.transpose(0, 1).reshape(t, self.heads * d) * torch.sigmoid(gate)


def _flat_rows(kv: PagedKV, start: int, end: int) -> torch.Tensor:
    """The rows of positions start..end-1 of every head in the pool viewed as [blocks * Hkv *
    block_size, D]: [Hkv, end - start]."""
    heads, bs = kv.pool.k.shape[1], kv.pool.block_size
    device = kv.table.ids.device
    pos = torch.arange(start, end, device=device)
    head0 = kv.table.ids[pos // bs].long() * (heads * bs) + pos % bs
    return head0[None, :] + bs * torch.arange(heads, device=device)[:, None]


def write_kv(kv: PagedKV, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Keys and values [T, Hkv, D] of positions start..start+T-1 into the sequence's blocks."""
    rows = _flat_rows(kv, start, start + k.shape[0])
    d = k.shape[-1]
    kv.pool.k.view(-1, d)[rows] = k.transpose(0, 1)
    kv.pool.v.view(-1, d)[rows] = v.transpose(0, 1)


def gather_kv(kv: PagedKV, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0..end-1 from the sequence's blocks, [Hkv, end, D] each."""
    rows = _flat_rows(kv, 0, end)
    d = kv.pool.k.shape[-1]
    return kv.pool.k.view(-1, d)[rows], kv.pool.v.view(-1, d)[rows]


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal GQA. q [H, T, D] at positions start..start+T; k, v [Hkv, S, D] with S = start + T."""
    t, s = q.shape[1], k.shape[1]
    mask, causal = None, False
    if start == 0:
        causal = t > 1
    elif t > 1:
        mask = torch.arange(s, device=q.device)[None, :] <= (start + torch.arange(t, device=q.device))[:, None]
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
    )[0]

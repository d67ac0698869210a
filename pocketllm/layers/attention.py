"""Gated full attention: query and gate interleaved per head in q_proj, q/k norm, partial RoPE,
causal GQA over the sequence's KV blocks (layers/cache.py), out * sigmoid(gate), row-parallel
o_proj."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm import host_memory
from pocketllm.config import ModelConfig
from pocketllm.distributed.state import tp
from pocketllm.layers.cache import KVPool, PagedKV
from pocketllm.layers.kv_layout import KV_BLOCK_SIZE, kv_head_range
from pocketllm.layers.context import DecodeRows, ForwardContext, Segment, per_sequence
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.paged_attention import cached_attention, decode_attention_rows, write_kv, write_kv_rows
from pocketllm.ops.fused import decode_ops
from pocketllm.ops.paged_kv import decode_attention_rows_torch
from pocketllm.ops.rotary import apply_rotary
from pocketllm.profiling.scopes import scope


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
        ops = decode_ops(dtype, torch.device(device))
        self.compiled_decode = ops.attention_decode
        # ops.device: what a device's pass shape runs between the projections (Triton kernels on
        # CUDA), read at each call as the norms and SiLU-and-multiply around the mixers read it.
        self.decode_ops = ops

    def allocate_pool(self, num_blocks: int, block_size: int = KV_BLOCK_SIZE) -> KVPool:
        shape = (num_blocks, self.kv_heads, block_size, self.head_dim)
        # On huge pages where the host has them, as the weights are: a decode step streams the
        # cache like a weight, and its memory is taken as pages are first written either way.
        return KVPool(host_memory.zeros(shape, self._dtype, self._device), host_memory.zeros(shape, self._dtype, self._device))

    def state_bytes(self) -> int:
        """What a sequence's own state of this layer takes: nothing, its KV blocks are the pool's."""
        return 0

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cache) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `cache` holds this layer's PagedKV of each sequence of
        the pass (ctx.segments), or for a pass of decode rows (ctx.decode_rows) its KV pool."""
        with scope("projections", "full.in"):
            qkv = self.qkv_proj(x, ctx)
        if ctx.decode_rows is not None:
            return self.o_proj(self._attend_rows(qkv, ctx.decode_rows, cache[0], ctx.shape.cpu_forms), ctx)
        return self.o_proj(per_sequence(self._attend, qkv, ctx, cache), ctx)

    def _attend(self, qkv: torch.Tensor, seq: Segment, kv: PagedKV) -> torch.Tensor:
        """One sequence's projected rows [T, q+k+v local] -> the gated output [T, heads*D],
        writing its keys and values into its blocks."""
        if seq.one_row and self.compiled_decode is not None:
            # One call from the q/k norms to the output gate: the same as the path below (the
            # tests compare them) up to fp32 summation order.
            with scope("attention_decode"):
                return self.compiled_decode(
                    qkv, self.q_norm.scale, self.k_norm.scale, self.q_norm.eps, seq.cos[0], seq.sin[0], kv.pool.k, kv.pool.v,
                    kv.table.ids, seq.start, self.heads, self.kv_heads, self.head_dim, self.scale,
                )
        q, k, v, gate = self._heads(qkv, seq.cos, seq.sin, seq.cpu_forms)
        with scope("kv_write"):
            if seq.cpu_forms:
                write_kv(kv, seq.start, k, v)
            else:
                self.decode_ops.device.write_kv(kv.pool.k, kv.pool.v, kv.table.ids, seq.start, k, v)
        with scope("full_attention"):
            # A device's decode row (outside a captured step: TP>1, POCKETLLM_CUDA_GRAPH=0) reads
            # through the step's kernel, only the positions the row holds, with the step's bits.
            rows = decode_attention_rows_torch if seq.cpu_forms else self.decode_ops.device.decode_attention_rows
            out = cached_attention(q, k, v, kv, seq.start, self.scale, rows)
        return self._gated(out, gate)

    def _attend_rows(self, qkv: torch.Tensor, rows: DecodeRows, pool: KVPool, cpu_forms: bool) -> torch.Tensor:
        """A decode row of each of B sequences [B, q+k+v local] -> [B, heads*D], each row's key
        and value written into its sequence's blocks: the rows _attend takes one by one, in one
        call of each op, the same ops on each row."""
        q, k, v, gate = self._heads(qkv, rows.cos, rows.sin, cpu_forms)
        with scope("kv_write"):
            if cpu_forms:
                write_kv_rows(pool, rows.tables, rows.pos, k, v)
            else:
                # A device's step: one kernel (Triton on CUDA) where the torch form is a dozen ops.
                self.decode_ops.device.write_kv_rows(pool.k, pool.v, rows.tables, rows.pos, k, v)
        with scope("full_attention"):
            if cpu_forms:
                out = decode_attention_rows(q, pool, rows.tables, rows.pos, self.scale)
            else:
                # A device's step: one kernel (Triton on CUDA) reading only the positions each row holds.
                out = self.decode_ops.device.decode_attention_rows(q, pool.k, pool.v, rows.tables, rows.pos, self.scale)
        return self._gated(out, gate)

    def _heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cpu_forms: bool):
        """Rows [T, q+k+v local] -> q [T, H, D] and k [T, Hkv, D] normed and rotated, v [T, Hkv,
        D], the output gate [T, H, D] (a view of the rows: _gated reads it in place)."""
        t, d = qkv.shape[0], self.head_dim
        q_gate, k, v = qkv.split(self.qkv_proj.part_sizes, dim=-1)
        q_gate = q_gate.view(t, self.heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]
        k = k.view(t, self.kv_heads, d)
        # A device's pass: one kernel each (Triton on CUDA); a CPU's: the torch forms.
        with scope("norms", "qk"):
            if cpu_forms:
                q, k = self.q_norm(q), self.k_norm(k)  # [T, H, D], [T, Hkv, D]
            else:
                q = self.decode_ops.device.add_rms_norm(q, None, self.q_norm.scale, self.q_norm.eps)[1]
                k = self.decode_ops.device.add_rms_norm(k, None, self.k_norm.scale, self.k_norm.eps)[1]
        with scope("rope"):
            rope = apply_rotary if cpu_forms else self.decode_ops.device.apply_rotary
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        return q, k, v.view(t, self.kv_heads, d), gate

    def _gated(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """out [T, H, D] (or [T, H*D]) * sigmoid(gate [T, H, D]) as [T, H*D]: the gate read where
        the projection wrote it (made contiguous first, it was one more copy of it a layer)."""
        with scope("gates", "full"):
            return (out.reshape(gate.shape) * torch.sigmoid(gate)).reshape(gate.shape[0], -1)

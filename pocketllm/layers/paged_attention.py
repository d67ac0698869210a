"""Attention over a sequence's paged KV cache (layers/cache.py) in torch: writing a pass's keys and
values into the sequence's blocks, and reading them back for its rows' attention.

What each kind of pass reads: rows starting a sequence attend to their own keys and values alone,
so nothing is read back; decode rows (one per sequence) gather the blocks their tables list and
mask the positions past their own, shapes set by the tables, not the data, so the same form runs
in a captured decode step; rows continuing a sequence (a prefill chunk after the first, a prompt
after a cached prefix) gather the cache into one tensor for torch's fused attention, a copy of
the cache that costs a small part of the attention itself once the rows are many. The compiled
bf16 decode kernel (pocketllm/ops/fused) reads the same layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.layers.cache import KVPool, PagedKV
from pocketllm.ops.paged_kv import decode_attention_rows_torch, flat_rows, write_kv_rows_torch, write_kv_torch


def write_kv(kv: PagedKV, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Keys and values [T, Hkv, D] of positions start..start+T-1 into the sequence's blocks."""
    write_kv_torch(kv.pool.k, kv.pool.v, kv.table.ids, start, k, v)


def gather_kv(kv: PagedKV, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0..end-1 from the sequence's blocks, [Hkv, end, D] each."""
    rows = flat_rows(kv.table.ids, kv.pool.k.shape[1], kv.pool.block_size, 0, end)
    d = kv.pool.k.shape[-1]
    return kv.pool.k.view(-1, d)[rows], kv.pool.v.view(-1, d)[rows]


def aligned_causal(device: torch.device) -> bool:
    """Whether rows going on from a cached prefix take the bottom-right-aligned causal bias (a
    device's fused kernels) rather than an explicit mask (a CPU's: the bits its invariance tests
    hold)."""
    return device.type != "cpu"


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal GQA. q [H, T, D] at positions start..start+T; k, v [Hkv, S, D] with S = start + T."""
    t, s = q.shape[1], k.shape[1]
    mask, causal = None, False
    if start == 0:
        causal = t > 1
    elif t > 1 and aligned_causal(q.device):
        # Rows going on from a cached prefix, on a device: the causal mask aligned to the last
        # key (row i sees keys 0..start+i), which the flash kernel takes as is. No fused kernel
        # takes an explicit mask with GQA (flash refuses masks, the memory-efficient kernel unequal
        # head counts), so one would fall to the math kernel, which builds every T x S score.
        # Imported here: the module brings in torch._dynamo, over half a second a process.
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(t, s)
    elif t > 1:
        mask = torch.arange(s, device=q.device)[None, :] <= (start + torch.arange(t, device=q.device))[:, None]
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
    )[0]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, start: int, scale: float,
                     rows_attention=decode_attention_rows_torch) -> torch.Tensor:
    """q [T, H, D] of positions start..start+T-1 over positions 0..start+T-1 of the sequence, whose
    new keys and values k, v [T, Hkv, D] are already written into its blocks: [T, H, D]. A decode
    row reads its blocks through `rows_attention` (decode_attention_rows_torch's contract; a
    device passes its kernel)."""
    t = q.shape[0]
    if start == 0:
        return attention_core(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0, scale).transpose(0, 1)
    if t == 1:
        return decode_attention(q[0], kv, start, scale, rows_attention)[None]
    keys, values = gather_kv(kv, start + t)
    return attention_core(q.transpose(0, 1), keys, values, start, scale).transpose(0, 1)


def decode_attention(q: torch.Tensor, kv: PagedKV, pos: int, scale: float, rows_attention=decode_attention_rows_torch) -> torch.Tensor:
    """One row at position pos: q [H, D] over positions 0..pos of the sequence's blocks; [H, D] in
    q's dtype. One sequence's case of decode_attention_rows, over its table's whole capacity as a
    step of several sequences reads it (a row's sums change with the positions they run over, so
    the two read alike to get alike bits)."""
    # A fill on the device, not a copy from the host, which would wait for the device's queue.
    at = torch.full((1,), pos, dtype=torch.long, device=q.device)
    return rows_attention(q[None], kv.pool.k, kv.pool.v, kv.table.ids[None], at, scale)[0]


def write_kv_rows(pool: KVPool, tables: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One position of each of B sequences: keys and values [B, Hkv, D] at positions pos [B]
    (long) into the blocks each sequence's table row (tables [B, M] int32) lists
    (ops/paged_kv.write_kv_rows_torch on the pool's tensors)."""
    write_kv_rows_torch(pool.k, pool.v, tables, pos, k, v)


def decode_attention_rows(q: torch.Tensor, pool: KVPool, tables: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """One row of each of B sequences: q [B, H, D] at positions pos [B] (long) over positions
    0..pos of the blocks each table row (tables [B, M] int32) lists; [B, H, D] in q's dtype.
    ops/paged_kv.decode_attention_rows_torch on the pool's tensors: every block of the tables
    read, the positions past a row's own masked, shapes set by the tables, not the data."""
    return decode_attention_rows_torch(q, pool.k, pool.v, tables, pos, scale)

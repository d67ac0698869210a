"""Attention over a sequence's paged KV cache (layers/cache.py) in torch: writing a pass's keys and
values into the sequence's blocks, and reading them back for its rows' attention.

What each kind of pass reads: rows starting a sequence attend to their own keys and values alone,
so nothing is read back; a decode row reads the pool in place, one matmul per run of consecutive
blocks and KV head (the pool is [blocks, Hkv, block_size, D], so a run of one head is a strided
batch of blocks, no copy); rows continuing a sequence (a prefill chunk after the first, a prompt
after a cached prefix) gather the cache into one tensor for torch's fused attention, a copy of
the cache that costs a small part of the attention itself once the rows are many. The compiled
bf16 decode kernel (pocketllm/ops/fused) reads the same layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.layers.cache import PagedKV

# At most this many consecutive blocks go into one matmul of a decode row; a pool in bf16 or fp16
# is widened to fp32 a piece at a time, so the widened copy stays this small.
PIECE_BLOCKS = 64


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


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, start: int, scale: float) -> torch.Tensor:
    """q [T, H, D] of positions start..start+T-1 over positions 0..start+T-1 of the sequence, whose
    new keys and values k, v [T, Hkv, D] are already written into its blocks: [T, H, D]."""
    t = q.shape[0]
    if start == 0:
        return attention_core(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0, scale).transpose(0, 1)
    if t == 1:
        return decode_attention(q[0], kv, start, scale)[None]
    keys, values = gather_kv(kv, start + t)
    return attention_core(q.transpose(0, 1), keys, values, start, scale).transpose(0, 1)


def block_runs(ids: list[int], positions: int, block_size: int) -> list[tuple[int, int, int]]:
    """(first block id, blocks, positions) of each run of consecutive block ids that holds positions
    0..positions-1 in order, at most PIECE_BLOCKS blocks each."""
    runs: list[tuple[int, int, int]] = []
    for i in range(-(-positions // block_size)):
        rows = min(block_size, positions - i * block_size)
        if runs and ids[i] == runs[-1][0] + runs[-1][1] and runs[-1][1] < PIECE_BLOCKS:
            first, n, held = runs[-1]
            runs[-1] = (first, n + 1, held + rows)
        else:
            runs.append((ids[i], 1, rows))
    return runs


def decode_attention(q: torch.Tensor, kv: PagedKV, pos: int, scale: float) -> torch.Tensor:
    """One row at position pos: q [H, D] over positions 0..pos, read from the pool in place; the
    scores, softmax and sums in fp32; [H, D] in q's dtype."""
    pool = kv.pool
    bs, hkv, d = pool.block_size, pool.k.shape[1], pool.k.shape[3]
    g = q.shape[0] // hkv
    q_t = q.float().view(hkv, g, d).transpose(1, 2)  # [Hkv, D, G]
    runs = block_runs(kv.table.held, pos + 1, bs)
    scores = torch.empty(hkv, g, pos + 1, dtype=torch.float32, device=q.device)
    at = 0
    for first, n, rows in runs:
        keys = pool.k[first : first + n].float()  # [n, Hkv, bs, D], a view for an fp32 pool
        for h in range(hkv):
            s = torch.bmm(keys[:, h], q_t[h].expand(n, d, g))  # [n, bs, G]
            scores[h, :, at : at + rows] = s.view(n * bs, g)[:rows].t()
        at += rows
    probs = torch.softmax(scores.mul_(scale), dim=-1)
    out = torch.zeros(hkv, g, d, dtype=torch.float32, device=q.device)
    at = 0
    for first, n, rows in runs:
        values = pool.v[first : first + n].float()
        # Positions past pos in the last block weigh nothing.
        p = F.pad(probs[:, :, at : at + rows], (0, n * bs - rows)).view(hkv, g, n, bs)
        for h in range(hkv):
            out[h] += torch.bmm(p[h].transpose(0, 1), values[:, h]).sum(0)  # [n, G, bs] @ [n, bs, D] -> [G, D]
        at += rows
    return out.view(hkv * g, d).to(q.dtype)

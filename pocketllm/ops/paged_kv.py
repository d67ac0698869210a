"""Where a sequence's positions live in a paged KV pool ([blocks, Hkv, block_size, D]; position p
is row p % block_size of block table[p // block_size]), writing a pass's keys and values there and
reading them back for a decode row of each of several sequences: the one form the layers'
attention and the device's KV-write and decode-attention kernels are held to."""

from __future__ import annotations

import torch


def flat_rows(table: torch.Tensor, heads: int, block_size: int, start: int, end: int) -> torch.Tensor:
    """The rows of positions start..end-1 of every head in a pool viewed as [blocks * Hkv *
    block_size, D]: [Hkv, end - start]."""
    pos = torch.arange(start, end, device=table.device)
    head0 = table[pos // block_size].long() * (heads * block_size) + pos % block_size
    return head0[None, :] + block_size * torch.arange(heads, device=table.device)[:, None]


def write_kv_torch(k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Keys and values [T, Hkv, D] of positions start..start+T-1 into the pools at the blocks
    `table` lists."""
    rows = flat_rows(table, k_pool.shape[1], k_pool.shape[2], start, start + k.shape[0])
    d = k.shape[-1]
    k_pool.view(-1, d)[rows] = k.transpose(0, 1)
    v_pool.view(-1, d)[rows] = v.transpose(0, 1)


def write_kv_rows_torch(k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> None:
    """One position of each of B sequences: keys and values [B, Hkv, D] at positions pos [B]
    (long) into the pools at the blocks each sequence's table row (tables [B, M] int32) lists.
    Nothing in it is sized by the data or branches on it: a captured decode step runs it as it is."""
    heads, bs, d = k_pool.shape[1], k_pool.shape[2], k_pool.shape[-1]
    block = tables.gather(1, (pos // bs)[:, None]).long()  # [B, 1]
    rows = ((block * heads + torch.arange(heads, device=pos.device)[None, :]) * bs + (pos % bs)[:, None]).flatten()
    k_pool.view(-1, d)[rows] = k.reshape(-1, d)
    v_pool.view(-1, d)[rows] = v.reshape(-1, d)


def decode_attention_rows_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, pos: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """One row of each of B sequences: q [B, H, D] at positions pos [B] (long) over positions
    0..pos of the blocks each table row (tables [B, M] int32) lists in the pools; [B, H, D] in
    q's dtype. The scores, softmax and sums in fp32, over all M blocks of every row with the
    positions past a row's own masked out: the shapes are the table's, not the data's, so a
    captured decode step runs it as it is, and what a row gets does not depend on the rows beside
    it (its sums do depend on M: a step and the layers read the slots' tables whole)."""
    b, h, d = q.shape
    hkv, bs, m = k_pool.shape[1], k_pool.shape[2], tables.shape[1]
    ids = tables.long()
    # [B, M, Hkv, bs, D] -> [B, Hkv, M * bs, D]: each head's positions in order.
    keys = k_pool[ids].transpose(1, 2).reshape(b, hkv, m * bs, d).float()
    values = v_pool[ids].transpose(1, 2).reshape(b, hkv, m * bs, d).float()
    scores = torch.matmul(q.float().view(b, hkv, h // hkv, d), keys.transpose(-1, -2))  # [B, Hkv, G, M * bs]
    past = torch.arange(m * bs, device=q.device)[None, :] > pos[:, None]
    probs = torch.softmax(scores.mul_(scale).masked_fill_(past[:, None, None, :], float("-inf")), dim=-1)
    return torch.matmul(probs, values).view(b, h, d).to(q.dtype)

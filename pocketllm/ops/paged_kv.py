"""Where a sequence's positions live in a paged KV pool ([blocks, Hkv, block_size, D]; position p
is row p % block_size of block table[p // block_size]), and writing a pass's keys and values
there: the one form the layers' attention and the device's KV-write kernel are held to."""

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

"""Paged attention of a decode row of each of B sequences (ops/paged_kv.decode_attention_rows_torch's
contract: q [B, H, D] at positions pos [B], the KV pools [blocks, Hkv, block_size, D], the rows'
block tables [B, M]). The torch form gathers every block each table lists, widens it to fp32 and
masks the positions past a row's own; here one program per (row, KV head) reads only the
positions 0..pos of its row, tile by tile through the table, for the G = H / Hkv query heads that
share the KV head, with an online softmax (a running max, sum and weighted sum of values, all
fp32). The loop's bound is read from pos inside the kernel: the grid and every shape stay those
of the tables, so a captured CUDA graph replays it at any positions.

What a split over the positions would add (flash-decoding: S programs per (row, KV head), each
over a 1/S share of the row's tiles, writing its max, sum and weighted sum; a second kernel
combining them): more programs when B * Hkv is small against the device's SMs and a row is long
(B = 1, Hkv = 4 is four programs). Not built: nothing measured says it is needed yet.

Each query head's scores are a dot of its q with a tile of keys, in fp32 ("ieee": no TF32, as the
torch form's fp32 matmul): tl.dot wants 16 rows at least, so the G heads are padded to 16.
A row's bits do not depend on the other rows of the call, nor on the table's width M."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import rounded

# Keys read per step of a program's loop: a tile inside one KV block (which must hold a whole
# number of them).
TILE = 32


@triton.jit
def _kernel(q_ptr, k_pool_ptr, v_pool_ptr, tables_ptr, pos_ptr, out_ptr, scale, n, group, heads_kv, block_size,
            q_row, q_head, table_row, table_col, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, G)
    cols = tl.arange(0, BLOCK_D)
    keys = tl.arange(0, BLOCK_N)
    head = kv * group + g  # [G]: the query heads of this KV head (those past `group` padding)
    q_mask = (g < group)[:, None] & (cols < n)[None, :]
    q = tl.load(q_ptr + b * q_row + head[:, None] * q_head + cols[None, :], mask=q_mask, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + b)
    top = tl.full([G], float("-inf"), tl.float32)
    total = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, BLOCK_D], tl.float32)
    for t in range(0, pos // BLOCK_N + 1):
        first = t * BLOCK_N
        block = tl.load(tables_ptr + b * table_row + (first // block_size) * table_col).to(tl.int64)
        at = first + keys  # [BLOCK_N] positions
        live = at <= pos
        # Row of position `at` of this head in the pool viewed as [blocks * Hkv * block_size, n].
        rows = (block * heads_kv + kv) * block_size + first % block_size + keys
        kv_mask = live[:, None] & (cols < n)[None, :]
        offsets = rows[:, None] * n + cols[None, :]
        k = tl.load(k_pool_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, BLOCK_N]
        s = tl.where(live[None, :], s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, axis=1))
        # The first tile holds position 0: new_top is finite from it on, and exp(-inf) = 0.
        fade = tl.exp(top - new_top)
        p = tl.exp(s - new_top[:, None])
        total = total * fade + tl.sum(p, axis=1)
        v = tl.load(v_pool_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * fade[:, None] + tl.dot(p, v, input_precision="ieee")
        top = new_top
    dtype = out_ptr.dtype.element_ty
    out = rounded(tl.div_rn(acc, total[:, None]), dtype)
    tl.store(out_ptr + (b * (group * heads_kv) + head[:, None]) * n + cols[None, :], out.to(dtype), mask=q_mask)


def decode_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, pos: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """decode_attention_rows_torch's contract: q [B, H, D] (last dim contiguous) at positions pos
    [B] (long, each within its table: pos // block_size < M) over the blocks tables [B, M] (int32)
    lists in the contiguous pools [blocks, Hkv, block_size, D] (block_size a multiple of 16);
    [B, H, D] new and contiguous, in q's dtype."""
    b, h, n = q.shape
    heads_kv, block_size = k_pool.shape[1], k_pool.shape[2]
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()) or v_pool.shape != k_pool.shape or k_pool.shape[3] != n \
            or h % heads_kv or q.stride(-1) != 1 or block_size % 16 or tables.shape[0] != b or pos.shape != (b,):
        raise ValueError(f"q {tuple(q.shape)}, pools {tuple(k_pool.shape)}, tables {tuple(tables.shape)}, pos {tuple(pos.shape)}: "
                         f"q must be [B, H, D] rows (last dim contiguous) over contiguous [blocks, Hkv, block_size, D] pools "
                         f"with H a multiple of Hkv and block_size of 16, tables [B, M], pos [B]")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b:
        group = h // heads_kv
        tile = TILE if block_size % TILE == 0 else 16
        _kernel[(b, heads_kv)](q, k_pool, v_pool, tables, pos, out, scale, n, group, heads_kv, block_size,
                               q.stride(0), q.stride(1), tables.stride(0), tables.stride(1),
                               G=max(16, triton.next_power_of_2(group)), BLOCK_N=tile, BLOCK_D=triton.next_power_of_2(n),
                               num_warps=4, enable_fp_fusion=False)
    return out

"""Paged attention of a decode row of each of B sequences (ops/paged_kv.decode_attention_rows_torch's
contract: q [B, H, D] at positions pos [B], the KV pools [blocks, Hkv, block_size, D], the rows'
block tables [B, M]). The torch form gathers every block each table lists, widens it to fp32 and
masks the positions past a row's own; here the kernels read only the positions 0..pos of each row.

Flash-decoding in two kernels. A row's positions are cut into shares of SPLIT positions, or, for
a row longer than `shares` of those, into `shares` shares of a whole number of tiles each; one
program per (row, KV head, share) reads its share tile by tile through the table, for the G = H /
Hkv query heads that share the KV head, with an online softmax (a running max, sum and weighted
sum of values, all fp32), and writes the three. One program per (row, query head) then combines
its row's live shares in order: rescaled to their common max, summed, divided. One program per
(row, KV head) over all of a row's positions would be four programs for a row of the 27B (Hkv =
4), a few of the device's SMs doing all the reading; shares make it a program per SPLIT positions
up to twice the device's SMs for a row. That bound sizes the grid and the fp32 partials (B x H x
shares x D) by the rows and the device, not by the tables' width: a share per SPLIT positions a
table can hold would make them grow with --max-len (6.4 GB of partials for 256 rows of 262144 positions at
the 27B's heads, and a million programs a layer, nearly all of them doing nothing).
Both loops' bounds are read from pos inside the kernels: the grids and every shape stay those of
the tables (shares past a row's position doing nothing), so a captured CUDA graph replays them at
any positions.

Each query head's scores are a dot of its q with a tile of keys: in fp32 ("ieee": no TF32, as the
torch form's fp32 matmul) for fp32 rows; for bf16 and fp16 rows a dot of the rows as they are with
fp32 sums, whose products are exact in fp32, so it differs from the torch form's widened matmul by
the order of its sums alone. An fp32 dot over the head's whole width (256 on the 27B) is lowered to
plain FMAs holding both operands' slices per thread, which spill to local memory on a GPU. Under
Triton's interpreter (the CPU tests) the narrow rows are widened first: its dot multiplies bf16's
stored bits as integers. tl.dot wants 16 rows at least, so the G heads are padded to 16.
A row's bits depend on its position (and the device's `shares`) alone: not on the other rows of the
call, nor on the table's width M (the shares it holds are cut at the same places, and only they
are combined)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .arith import rounded

# Keys read per step of a program's loop: a tile inside one KV block (which must hold a whole
# number of them).
TILE = 32
# Positions of a row one program reads, unless the row is longer than the device's shares of them
# (a whole number of tiles).
SPLIT = 256
# A row's shares at most, off a GPU (Triton's interpreter): few, so that the CPU tests' rows of a
# few thousand positions reach shares longer than SPLIT.
INTERPRETED_SHARES = 4


@functools.cache
def device_shares(device: torch.device, heads_kv: int) -> int:
    """A row's shares at most on `device`: its KV heads' programs over them fill each SM twice."""
    if device.type != "cuda":
        return INTERPRETED_SHARES
    return max(1, -(-2 * torch.cuda.get_device_properties(device).multi_processor_count // heads_kv))


@triton.jit
def _span(pos, BLOCK_N: tl.constexpr, TILES: tl.constexpr, shares):
    """The tiles of a row at position pos; of each of its shares (TILES, or more where the row
    holds more than `shares` shares of them); and how many shares it holds."""
    tiles = (pos // BLOCK_N + 1).to(tl.int32)
    span = tl.maximum(TILES, tl.cdiv(tiles, shares))
    return tiles, span, tl.cdiv(tiles, span)


@triton.jit
def _kernel(q_ptr, k_pool_ptr, v_pool_ptr, tables_ptr, pos_ptr, top_ptr, total_ptr, acc_ptr, scale, n, group, heads_kv,
            block_size, splits, shares, q_row, q_head, table_row, table_col,
            G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, NARROW: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    share = tl.program_id(2)
    pos = tl.load(pos_ptr + b)
    tiles, span, held = _span(pos, BLOCK_N, TILES, shares)
    # A share past the row's position reads and writes nothing (the combine reads only the live
    # ones): at short positions most of a wide table's programs end here.
    if share < held:
        g = tl.arange(0, G)
        cols = tl.arange(0, BLOCK_D)
        keys = tl.arange(0, BLOCK_N)
        head = kv * group + g  # [G]: the query heads of this KV head (those past `group` padding)
        q_mask = (g < group)[:, None] & (cols < n)[None, :]
        q = tl.load(q_ptr + b * q_row + head[:, None] * q_head + cols[None, :], mask=q_mask, other=0.0)
        if not NARROW:
            q = q.to(tl.float32)
        top = tl.full([G], float("-inf"), tl.float32)
        total = tl.zeros([G], tl.float32)
        acc = tl.zeros([G, BLOCK_D], tl.float32)
        for t in range(share * span, tl.minimum(tiles, (share + 1) * span)):
            first = t * BLOCK_N
            block = tl.load(tables_ptr + b * table_row + (first // block_size) * table_col).to(tl.int64)
            at = first + keys  # [BLOCK_N] positions
            live = at <= pos
            # Row of position `at` of this head in the pool viewed as [blocks * Hkv * block_size, n].
            rows = (block * heads_kv + kv) * block_size + first % block_size + keys
            kv_mask = live[:, None] & (cols < n)[None, :]
            offsets = rows[:, None] * n + cols[None, :]
            k = tl.load(k_pool_ptr + offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            if NARROW:
                s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale  # [G, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            s = tl.where(live[None, :], s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, axis=1))
            # A share's first tile holds its first position: new_top is finite from it on, and
            # exp(-inf) = 0.
            fade = tl.exp(top - new_top)
            p = tl.exp(s - new_top[:, None])
            total = total * fade + tl.sum(p, axis=1)
            v = tl.load(v_pool_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * fade[:, None] + tl.dot(p, v, input_precision="ieee")
            top = new_top
        part = (b * (group * heads_kv) + head) * splits + share  # [G]: this share of each query head
        tl.store(top_ptr + part, top, mask=g < group)
        tl.store(total_ptr + part, total, mask=g < group)
        tl.store(acc_ptr + part[:, None] * n + cols[None, :], acc, mask=q_mask)


@triton.jit
def _combine_kernel(top_ptr, total_ptr, acc_ptr, pos_ptr, out_ptr, n, heads, splits, shares,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < n
    _, _, live = _span(tl.load(pos_ptr + b), BLOCK_N, TILES, shares)  # the shares holding the row's positions
    base = (b * heads + head) * splits
    top = tl.load(top_ptr + base)  # share 0 holds position 0: finite
    for share in range(1, live):
        top = tl.maximum(top, tl.load(top_ptr + base + share))
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for share in range(0, live):
        scale = tl.exp(tl.load(top_ptr + base + share) - top)
        total += tl.load(total_ptr + base + share) * scale
        acc += tl.load(acc_ptr + (base + share) * n + cols, mask=ok, other=0.0) * scale
    dtype = out_ptr.dtype.element_ty
    out = rounded(tl.div_rn(acc, total), dtype)
    tl.store(out_ptr + (b * heads + head) * n + cols, out.to(dtype), mask=ok)


def decode_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, pos: torch.Tensor,
                          scale: float, shares: int | None = None) -> torch.Tensor:
    """decode_attention_rows_torch's contract: q [B, H, D] (last dim contiguous) at positions pos
    [B] (long, each within its table: pos // block_size < M) over the blocks tables [B, M] (int32)
    lists in the contiguous pools [blocks, Hkv, block_size, D] (block_size a multiple of 16);
    [B, H, D] new and contiguous, in q's dtype. `shares`: a row's shares at most (default: the
    device's, device_shares)."""
    b, h, n = q.shape
    heads_kv, block_size = k_pool.shape[1], k_pool.shape[2]
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()) or v_pool.shape != k_pool.shape or k_pool.shape[3] != n \
            or h % heads_kv or q.stride(-1) != 1 or block_size % 16 or tables.shape[0] != b or pos.shape != (b,) or not pos.is_contiguous():
        raise ValueError(f"q {tuple(q.shape)}, pools {tuple(k_pool.shape)}, tables {tuple(tables.shape)}, pos {tuple(pos.shape)}: "
                         f"q must be [B, H, D] rows (last dim contiguous) over contiguous [blocks, Hkv, block_size, D] pools "
                         f"with H a multiple of Hkv and block_size of 16, tables [B, M], pos [B] contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b:
        group = h // heads_kv
        tile = TILE if block_size % TILE == 0 else 16
        tiles = SPLIT // tile
        shares = shares or device_shares(q.device, heads_kv)
        # The shares a row of the table's width can hold: no more than that, nor than `shares`.
        splits = min(triton.cdiv(tables.shape[1] * block_size, SPLIT), shares)
        top, total = (torch.empty(b, h, splits, dtype=torch.float32, device=q.device) for _ in range(2))
        acc = torch.empty(b, h, splits, n, dtype=torch.float32, device=q.device)
        block_d = triton.next_power_of_2(n)
        # Under Triton's interpreter narrow rows are widened first (the module's docstring says why).
        narrow = q.dtype == k_pool.dtype and q.dtype in (torch.bfloat16, torch.float16) and not triton.knobs.runtime.interpret
        _kernel[(b, heads_kv, splits)](q, k_pool, v_pool, tables, pos, top, total, acc, scale, n, group, heads_kv, block_size,
                                       splits, shares, q.stride(0), q.stride(1), tables.stride(0), tables.stride(1),
                                       G=max(16, triton.next_power_of_2(group)), BLOCK_N=tile, BLOCK_D=block_d, TILES=tiles,
                                       NARROW=narrow, num_warps=4, enable_fp_fusion=False)
        _combine_kernel[(b, h)](top, total, acc, pos, out, n, h, splits, shares, BLOCK_N=tile, BLOCK_D=block_d, TILES=tiles,
                                num_warps=max(1, min(4, block_d // 64)), enable_fp_fusion=False)
    return out

"""A pass's keys and values into a sequence's paged KV blocks (layers.paged_attention.write_kv's
contract, on the tensors: pools [blocks, Hkv, block_size, D], the sequence's block table), and a
decode step's, one position of each of B sequences (ops/paged_kv.write_kv_rows_torch's). The
torch forms build the flat row index of every (head, position) and scatter twice (the step's, a
dozen small ops a layer); here one program per (position or row, head) copies that row of k and
of v to where the table says, the step's reading each row's position and block from the device.
A copy: the bits are the inputs'."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import launch_options


# `start` not specialized: Triton compiles an integer argument apart when it is 1 or a multiple
# of 16, and a pass going on from a cached prefix starts anywhere (the warm-up starts at 0 only): a
# first request going on at another position would wait for a compile.
@triton.jit(do_not_specialize=["start"])
def _kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, tables_ptr, pos_ptr, start, n, heads, block_size, k_row, k_head, v_row, v_head,
            table_row, table_col, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Program (t, h): row t's head h. ROWS: row t is position pos[t] of table row t (a decode
    step's); else position start + t of the one table (table_row 0: a pass's)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if ROWS:
        pos = tl.load(pos_ptr + t)
    else:
        pos = start + t
    block = tl.load(tables_ptr + t * table_row + (pos // block_size) * table_col).to(tl.int64)
    dst = ((block * heads + h) * block_size + pos % block_size) * n + cols
    tl.store(k_pool_ptr + dst, tl.load(k_ptr + t * k_row + h * k_head + cols, mask=mask), mask=mask)
    tl.store(v_pool_ptr + dst, tl.load(v_ptr + t * v_row + h * v_head + cols, mask=mask), mask=mask)


def _unfit(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether k, v are not [rows, Hkv, D] (last dim contiguous) of contiguous pools of their dtype."""
    heads, n = k.shape[1], k.shape[2]
    return not (k_pool.is_contiguous() and v_pool.is_contiguous()) or k_pool.shape[1] != heads or k_pool.shape[3] != n \
        or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1 or k_pool.dtype != k.dtype or v_pool.dtype != v.dtype


def _launch(k_pool, v_pool, tables, pos, start: int, table_row: int, table_col: int, k, v, rows: bool) -> None:
    t, heads, n = k.shape
    if t:
        block = triton.next_power_of_2(n)
        _kernel[(t, heads)](k, v, k_pool, v_pool, tables, pos, start, n, heads, k_pool.shape[2], k.stride(0), k.stride(1), v.stride(0),
                            v.stride(1), table_row, table_col, BLOCK=block, ROWS=rows, **launch_options(block))


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (last dim contiguous) of positions start..start+T-1 into k_pool, v_pool
    [blocks, Hkv, block_size, D] (contiguous, k's dtype) at the blocks table (int32) lists."""
    if _unfit(k_pool, v_pool, k, v):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, pools {tuple(k_pool.shape)}: k and v must be [T, Hkv, D] "
                         f"rows of contiguous [blocks, Hkv, block_size, D] pools of their dtype")
    # Every row reads the one table (a row stride of 0); `pos` is not read.
    _launch(k_pool, v_pool, table, table, start, 0, table.stride(0), k, v, rows=False)


def write_kv_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """k, v [B, Hkv, D] (last dim contiguous) of one position of each of B sequences, pos [B]
    (long, contiguous), into k_pool, v_pool [blocks, Hkv, block_size, D] (contiguous, k's dtype) at
    the blocks each row of tables [B, M] (int32) lists."""
    b = k.shape[0]
    if _unfit(k_pool, v_pool, k, v) or tables.shape[0] != b or pos.shape != (b,) or not pos.is_contiguous():
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, pools {tuple(k_pool.shape)}, tables {tuple(tables.shape)}, "
                         f"pos {tuple(pos.shape)}: k and v must be [B, Hkv, D] rows of contiguous [blocks, Hkv, block_size, D] "
                         f"pools of their dtype, tables [B, M], pos [B] contiguous")
    _launch(k_pool, v_pool, tables, pos, 0, tables.stride(0), tables.stride(1), k, v, rows=True)

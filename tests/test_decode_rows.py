"""The decode-row forms a step of several sequences runs (one token of each of B sequences, each
from its own state) against one sequence's forms run on each in turn: the gated delta rule, the
conv window, the KV write and the paged attention read."""

from __future__ import annotations

import torch

from pocketllm.layers.cache import BlockTable, KVPool, PagedKV
from pocketllm.layers.paged_attention import decode_attention, decode_attention_rows, write_kv, write_kv_rows
from pocketllm.ops.causal_conv import causal_conv1d_rows_step_, causal_conv1d_step_
from pocketllm.ops.gated_delta import gated_delta_step_torch_
from pocketllm.ops.gated_delta.recurrent import gated_delta_rows_torch_

B, HK, HV, D = 3, 2, 6, 16


def test_the_gated_delta_rows_are_each_sequences_step():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, HK, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, HV, D, generator=g)
    gate, beta = -torch.rand(B, HV, generator=g), torch.rand(B, HV, generator=g)
    state = torch.randn(B, HV, D, D, generator=g) * 0.1
    rows_state, one_state = state.clone(), state.clone()
    rows = gated_delta_rows_torch_(q, k, v, gate, beta, rows_state)
    for b in range(B):
        one = gated_delta_step_torch_(q[b : b + 1], k[b : b + 1], v[b : b + 1], gate[b : b + 1], beta[b : b + 1], one_state[b])
        assert torch.equal(rows[b], one[0]) and torch.equal(rows_state[b], one_state[b])


def test_the_conv_rows_are_each_sequences_step():
    g = torch.Generator().manual_seed(1)
    x, taps, state = torch.randn(B, 40, generator=g), torch.randn(4, 40, generator=g), torch.randn(B, 3, 40, generator=g)
    rows_state, one_state = state.clone(), state.clone()
    rows = causal_conv1d_rows_step_(x, taps, rows_state)
    for b in range(B):
        assert torch.allclose(rows[b], causal_conv1d_step_(x[b : b + 1], taps, one_state[b])[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(rows_state, one_state)


def _pool(blocks: int, g) -> KVPool:
    return KVPool(torch.randn(blocks, 2, 64, D, generator=g), torch.randn(blocks, 2, 64, D, generator=g))


def test_the_kv_write_and_attention_rows_are_each_sequences():
    g = torch.Generator().manual_seed(2)
    rows_pool = _pool(12, g)
    one_pool = KVPool(rows_pool.k.clone(), rows_pool.v.clone())
    # Each sequence's blocks out of order; the rows' tables padded past what a sequence holds.
    tables = torch.tensor([[3, 9, 1, 0], [5, 0, 0, 0], [8, 2, 11, 7]], dtype=torch.int32)
    pos = torch.tensor([100, 7, 255])
    k, v = torch.randn(B, 2, D, generator=g), torch.randn(B, 2, D, generator=g)
    write_kv_rows(rows_pool, tables, pos, k, v)
    q = torch.randn(B, 4, D, generator=g)
    rows = decode_attention_rows(q, rows_pool, tables, pos, D**-0.5)
    for b in range(B):
        table = BlockTable(tables[b].clone())
        table.held = tables[b, : int(pos[b]) // 64 + 1].tolist()
        kv = PagedKV(one_pool, table)
        write_kv(kv, int(pos[b]), k[b : b + 1], v[b : b + 1])
        assert torch.equal(rows[b], decode_attention(q[b], kv, int(pos[b]), D**-0.5))
    assert torch.equal(rows_pool.k, one_pool.k) and torch.equal(rows_pool.v, one_pool.v)
    # The blocks a table lists past a row's position weigh nothing (within rounding: the sums run
    # over more terms).
    wider = torch.cat((tables, torch.full((B, 3), 4, dtype=torch.int32)), dim=1)
    torch.testing.assert_close(decode_attention_rows(q, rows_pool, wider, pos, D**-0.5), rows, rtol=1e-6, atol=1e-6)

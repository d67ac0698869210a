"""The rotary table against cos/sin computed for the positions asked, across the table's growth."""

from __future__ import annotations

import pytest
import torch

from pocketllm.layers.rotary import RotaryEmbedding


def direct(rope: RotaryEmbedding, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + rows, dtype=torch.float32)
    freqs = pos[:, None] * rope.inv_freq[None, :]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("start,rows", [(0, 1), (0, 300), (255, 1), (256, 1), (511, 2), (1000, 3000), (70_000, 1)],
                         ids=lambda v: str(v))
def test_table_rows_match_the_positions_asked(start, rows):
    rope = RotaryEmbedding(32, 10_000.0, "cpu")
    rope.cos_sin(0, 1)  # a first table of 256 rows, which the asks past it must grow
    cos, sin = rope.cos_sin(start, rows)
    ref_cos, ref_sin = direct(rope, start, rows)
    assert cos.shape == (rows, 16)
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=0)


def test_decode_positions_slice_one_table_that_doubles():
    # Decode asks one position at a time: each ask is a view of the same table until a position
    # falls outside it, and then the table doubles rather than growing by one row. Every result is
    # kept alive, so no two could share an address unless they share the table.
    rope = RotaryEmbedding(32, 10_000.0, "cpu")
    kept = [rope.cos_sin(0, 512)[0]] + [rope.cos_sin(pos, 1)[0] for pos in range(512, 1025)]
    storages = [t.untyped_storage().data_ptr() for t in kept]
    assert storages[1] != storages[0]  # position 512 grew the 512-row table
    assert set(storages[1:513]) == {storages[1]}  # 512..1023: one 1024-row table
    assert storages[513] != storages[1]  # position 1024 grew it again


def test_a_reserved_table_serves_the_whole_sequence():
    # The engine reserves a sequence's length when it starts one: no pass of it rebuilds the table.
    rope = RotaryEmbedding(32, 10_000.0, "cpu")
    rope.reserve(3000)
    kept = [rope.cos_sin(0, 2000)[0], rope.cos_sin(2000, 1)[0], rope.cos_sin(2999, 1)[0]]
    assert len({t.untyped_storage().data_ptr() for t in kept}) == 1
    torch.testing.assert_close(kept[2], direct(rope, 2999, 1)[0], atol=2e-6, rtol=0)

"""The rotary table against cos/sin computed for the positions asked, across the table's growth."""

from __future__ import annotations

import pytest
import torch

from pocketllm.layers.rotary import RotaryEmbedding


def direct(rope: RotaryEmbedding, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + rows, dtype=torch.float32)
    freqs = pos[:, None] * rope.inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("start,rows", [(0, 1), (0, 300), (255, 1), (511, 2), (1000, 3000), (70_000, 1)], ids=lambda v: str(v))
def test_table_rows_match_the_positions_asked(start, rows):
    rope = RotaryEmbedding(32, 10_000.0, "cpu")
    rope.reserve(256)  # a first table, which the asks past it must grow
    cos, sin = rope.cos_sin(start, rows)
    ref_cos, ref_sin = direct(rope, start, rows)
    assert cos.shape == (rows, 16)
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=0)


def test_a_reserved_table_serves_the_whole_sequence():
    # The engine reserves a sequence's length when it starts one: each decode position is then a
    # view of that one table. Every result is kept alive, so no two could share an address unless
    # they share the table.
    rope = RotaryEmbedding(32, 10_000.0, "cpu")
    rope.reserve(3000)
    kept = [rope.cos_sin(0, 2000)[0]] + [rope.cos_sin(pos, 1)[0] for pos in range(2000, 3000)]
    assert {storage(t) for t in kept} == {storage(kept[0])}
    torch.testing.assert_close(kept[-1], direct(rope, 2999, 1)[0], atol=2e-6, rtol=0)
    # A smaller reservation keeps the table; a position past it grows a new one.
    rope.reserve(100)
    assert storage(rope.cos_sin(2999, 1)[0]) == storage(kept[0])
    assert storage(rope.cos_sin(3000, 1)[0]) != storage(kept[0])

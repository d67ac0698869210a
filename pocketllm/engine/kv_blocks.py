"""The KV block pool's bookkeeping: which blocks are free and which each slot's sequence holds. A
block may be held more than once (by sequences, and by the prefix cache's entries, which share the
blocks of a cached prefix): it is free when nothing holds it. Every rank
keeps its own allocator over its own pool; the ranks run the same calls in the same order (rank
0's plan says what to release, cache and restore), so their tables list the same block ids. How
big the pool may be is the slots' memory budget (engine/slots.py)."""

from __future__ import annotations

import torch

from pocketllm.device import copy_to_device_
from pocketllm.layers.cache import BlockTable
from pocketllm.layers.kv_layout import KV_BLOCK_SIZE, blocks_for


class BlockAllocator:
    def __init__(self, num_blocks: int, slots: int, max_len: int, device, block_size: int = KV_BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        # A stack, lowest ids on top: the same calls in the same order give the same ids.
        self.free = list(range(num_blocks - 1, -1, -1))
        self.holders = [0] * num_blocks  # how many tables and cache entries hold each block
        # Every slot's table as one [slots + 1, capacity] tensor (BlockTable rows are views). The
        # last row, the padding slot's, lists only `num_blocks`: a block past the allocator's, which
        # the pools hold for the rows a fixed-size step runs beyond its real ones to write into.
        # Columns to a multiple of 4: each row (a slot's table, which the KV kernels take as a
        # pointer) then starts 16-byte aligned, and Triton compiles a pointer that is not apart,
        # so a first request in a slot the warm-up did not use would wait for a compile.
        columns = -(-blocks_for(max_len, block_size) // 4) * 4
        self.ids = torch.zeros(slots + 1, columns, dtype=torch.int32, device=device)
        self.ids[slots] = num_blocks
        self.tables = [BlockTable(self.ids[i]) for i in range(slots)]

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def needed(self, slot: int, positions: int) -> int:
        """Blocks the slot's sequence lacks to hold `positions` positions."""
        return max(0, blocks_for(positions, self.block_size) - self.tables[slot].count)

    def grow(self, slot: int, positions: int) -> None:
        """Give the slot's sequence the blocks it lacks to hold `positions` positions."""
        table = self.tables[slot]
        n = self.needed(slot, positions)
        if n > len(self.free):
            raise RuntimeError(f"the KV pool has {len(self.free)} free blocks of {self.num_blocks}, a sequence of {positions} positions needs {n} more")
        if n > table.ids.shape[0] - table.count:
            raise RuntimeError(f"sequence of {positions} positions exceeds the {table.ids.shape[0] * self.block_size} a slot holds")
        new = [self.free.pop() for _ in range(n)]
        self.hold(new)
        self._append(table, new)

    def adopt(self, slot: int, blocks: list[int]) -> None:
        """Give the slot's (empty) sequence these blocks, shared with whatever else holds them."""
        self.hold(blocks)
        self._append(self.tables[slot], blocks)

    def release(self, slot: int) -> None:
        """Let go of every block of the slot's sequence."""
        table = self.tables[slot]
        self.drop(table.held)
        table.held = []

    def hold(self, blocks: list[int]) -> None:
        for b in blocks:
            self.holders[b] += 1

    def drop(self, blocks: list[int]) -> None:
        """Let go of these blocks once each; those nothing holds any more are free."""
        freed = []
        for b in blocks:
            self.holders[b] -= 1
            if self.holders[b] == 0:
                freed.append(b)
        self.free.extend(reversed(freed))

    @staticmethod
    def _append(table: BlockTable, blocks: list[int]) -> None:
        if blocks:
            copy_to_device_(table.ids[table.count : table.count + len(blocks)], torch.tensor(blocks, dtype=torch.int32))
            table.held.extend(blocks)

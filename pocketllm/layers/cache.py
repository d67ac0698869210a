"""Per-layer decode state. A Gated DeltaNet layer keeps, per running sequence, its conv window and
fp32 recurrent state (fixed-size). A full-attention layer keeps its keys and values in a pool of
fixed-size blocks shared by every sequence: a sequence holds the blocks its block table lists, so
KV memory is taken as positions are written, not reserved for the longest sequence up front.

Each layer's state of a sequence answers for itself what the engine's slots ask of it (reset for
a new sequence, save and load for the prefix cache, addresses for the compiled step), so nothing
above checks which kind of state a layer has; what a save copies is its mixer's state_bytes(),
known before any state is allocated (the prefix cache's budget needs it first).

The layout (what the compiled decode kernel and the torch path both read): per layer, K and V
pools each [num_blocks, Hkv_local, KV_BLOCK_SIZE, D], contiguous; position p of a sequence is row
p % KV_BLOCK_SIZE of block table[p // KV_BLOCK_SIZE] (one table per sequence, the same block ids in
every layer's pool)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass
class GDNState:
    conv: torch.Tensor  # [K-1, C_local], the last K-1 conv inputs, oldest first
    recurrent: torch.Tensor  # [Hv_local, Dk, Dv] fp32

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()

    def save(self, like=torch.empty_like) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the state, to go on from later (load), into tensors like(t) gives."""
        return like(self.conv).copy_(self.conv), like(self.recurrent).copy_(self.recurrent)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What save copies."""
        return self.conv, self.recurrent

    def load(self, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv.copy_(saved[0])
        self.recurrent.copy_(saved[1])

    def addresses(self) -> dict[str, int]:
        """Where a compiled decode step finds the state (the fields of step_bf16.c's SeqLayer)."""
        return {"conv": self.conv.data_ptr(), "state": self.recurrent.data_ptr()}


@dataclass
class GDNStates:
    """One Gated DeltaNet layer's state of every slot, stacked (a slot's GDNState is a view of its
    row): a step of several sequences gathers theirs by slot index, with no per-sequence call."""

    conv: torch.Tensor  # [slots, K-1, C_local]
    recurrent: torch.Tensor  # [slots, Hv_local, Dk, Dv] fp32

    @property
    def count(self) -> int:
        return self.conv.shape[0]

    def slot(self, i: int) -> GDNState:
        return GDNState(self.conv[i], self.recurrent[i])


@dataclass
class KVPool:
    """One full-attention layer's keys and values, for every sequence."""

    k: torch.Tensor  # [num_blocks, Hkv_local, block_size, D]
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def copy_block(self, to: int, source: int) -> None:
        self.k[to] = self.k[source]
        self.v[to] = self.v[source]


class BlockTable:
    """The KV blocks of one sequence in position order: ids[:count] (int32, on the pool's device,
    room for the longest sequence a slot holds; a row of the allocator's table of every slot,
    where a step of several sequences gathers them by slot index)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self.held: list[int] = []  # the same ids, as the allocator reads them

    @property
    def count(self) -> int:
        return len(self.held)


@dataclass
class PagedKV:
    """A full-attention layer's state for one sequence: the layer's pool and the sequence's table."""

    pool: KVPool
    table: BlockTable

    # The sequence's KV positions live in pool blocks its table holds: the block allocator frees
    # and shares them (a cached prefix holds its blocks rather than copying them), so a new
    # sequence, a snapshot and a restore have nothing of this layer's own to do.
    def reset(self) -> None:
        pass

    def save(self, like=None) -> None:
        return None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def load(self, saved: None) -> None:
        pass

    def addresses(self) -> dict[str, int]:
        """Where a compiled decode step finds the pool and the table (step_bf16.c's SeqLayer)."""
        k = self.pool.k
        return {"k_pool": k.data_ptr(), "v_pool": self.pool.v.data_ptr(), "table": self.table.ids.data_ptr(), "num_blocks": k.shape[0], "block_size": k.shape[2]}


@dataclass
class CachedPrefix:
    """A prefix of some sequence kept for later ones that start with the same tokens: the KV
    blocks of its positions (held, shared with whoever else holds them) and every layer's saved
    state after its last position (a Gated DeltaNet layer's conv and recurrent state)."""

    length: int
    blocks: list[int]
    saved: list

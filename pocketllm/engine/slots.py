"""The hybrid model's per-sequence state in one place: the slots a pass runs its sequences in, each
slot's state per layer (a Gated DeltaNet layer's conv and recurrent state, a full-attention
layer's view of the shared KV pool through the slot's block table), the KV block pool's
bookkeeping, the prefix cache's entries, and the memory budget they share (the pool's blocks, the
prefix cache's copies of sequence state). Everything that reserves, grows, releases, snapshots,
restores or evicts a sequence's state goes through here; each layer's state answers for itself
(layers/cache.py), so nothing checks which kind a layer keeps."""

from __future__ import annotations

import os

import torch

from pocketllm import host_memory
from pocketllm.config import FULL
from pocketllm.distributed.state import all_gather_cat, tp
from pocketllm.engine.budgets import DEFAULT_KV_FRACTION, PREFIX_CACHE_FRACTION
from pocketllm.engine.kv_blocks import BlockAllocator
from pocketllm.layers.cache import CachedPrefix, PagedKV
from pocketllm.layers.kv_layout import blocks_for, kv_block_bytes
from pocketllm.topology import meminfo_bytes



class Slots:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.states: list[list] = []  # per slot, its state of every layer
        self.capacity = 0  # positions a slot holds
        self.blocks: BlockAllocator | None = None
        self.pools: list = []  # the full-attention layers' KVPools
        self._pool_blocks = 0  # blocks the pools have room for
        # The layers' own state of every slot, stacked, by layer index (GDNStates): room for the
        # slots asked for and one more, the padding slot (`padding`).
        self.stacked: dict = {}
        self._pool_of: dict = {}  # the KV pool by layer index
        self.generation = 0  # counts reserves: a step holding these tensors' addresses rebuilds
        self.cached: dict[int, CachedPrefix] = {}  # prefix cache entries by id (rank 0 chooses them)

    def __getitem__(self, slot: int) -> list:
        return self.states[slot]

    def reserve(self, count: int, max_len: int, kv_blocks: int | None = None) -> None:
        """Room for `count` sequences of up to `max_len` positions each: per slot its layers'
        own state, and one KV pool of `kv_blocks` blocks for them all (default, and at most,
        what `count` sequences of `max_len` fill; at least what one fills), every block free. The
        memory is allocated once: a later call asking for no more reuses it, with fresh
        bookkeeping of exactly the blocks asked for."""
        one, every = blocks_for(max_len), count * blocks_for(max_len)
        blocks = every if kv_blocks is None else min(kv_blocks, every)
        if blocks < one:
            raise ValueError(f"a KV pool of {blocks} blocks cannot hold one sequence of {max_len} positions ({one} blocks)")
        layers = self.model.layers
        full = [i for i, layer in enumerate(layers) if layer.kind == FULL]
        # The old state goes before new is allocated.
        self.states, self.cached = [], {}
        # One block more than the allocator hands out: the padding slot's (kv_blocks.py).
        if blocks + 1 > self._pool_blocks:
            self.pools = []
            self.pools = [layers[i].mixer.allocate_pool(blocks + 1) for i in full]
            self._pool_blocks = blocks + 1
        if not self.stacked or next(iter(self.stacked.values())).count < count + 1:
            self.stacked = {}
            self.stacked = {i: layer.mixer.allocate_states(count + 1) for i, layer in enumerate(layers) if i not in full}
        self.blocks = BlockAllocator(blocks, count, max_len, self.device)
        pools = self._pool_of = dict(zip(full, self.pools))
        self.states = [
            [PagedKV(pools[i], table) if i in pools else self.stacked[i].slot(slot) for i in range(len(layers))]
            for slot, table in enumerate(self.blocks.tables)
        ]
        self.capacity = max_len
        self.generation += 1

    @property
    def padding(self) -> int:
        """The slot a fixed-size step's rows beyond its real ones run in: never a sequence's, its
        table lists only a block the allocator never hands out, its state is scratch."""
        return len(self.states)

    def stacked_state(self, layer: int):
        """Layer `layer`'s state of every slot at once: its GDNStates, or its KV pool."""
        return self.stacked[layer] if layer in self.stacked else self._pool_of[layer]

    def begin(self, slot: int) -> None:
        """A new sequence in `slot`: every layer's state cleared, its KV blocks freed."""
        for state in self.states[slot]:
            state.reset()
        self.blocks.release(slot)

    def grow(self, slot: int, end: int) -> None:
        """Room in `slot` for its sequence's positions up to `end` (RuntimeError past the slot's
        capacity, or when the pool lacks the blocks: the caller makes room first)."""
        if end > self.capacity:
            raise RuntimeError(f"sequence of {end} positions exceeds the {self.capacity} reserved per slot")
        self.blocks.grow(slot, end)

    def release(self, slot: int) -> None:
        """Free the KV blocks of the sequence in `slot` (it ended, or waits to be run again)."""
        self.blocks.release(slot)

    def sequence_bytes(self) -> int:
        """What one sequence's own state takes: what a prefix cache entry copies of it."""
        return sum(layer.mixer.state_bytes() for layer in self.model.layers)

    def snapshot(self, slot: int, entry: int, length: int) -> None:
        """Keep the first `length` positions of the sequence in `slot`, which has run exactly that
        many, as prefix cache entry `entry`: its KV blocks, held (not copied), and a copy of every
        layer's own state. The positions in those blocks never change: the sequence only appends."""
        blocks = self.blocks.tables[slot].held[: blocks_for(length, self.blocks.block_size)]
        self.blocks.hold(blocks)
        self.cached[entry] = CachedPrefix(length, list(blocks), self._copies(self.states[slot]))

    def _copies(self, states: list) -> list:
        """Copies of a sequence's layer states, for a prefix cache entry: on a CPU in one Arena of
        their own, so that an entry, long-lived among a pass's short-lived buffers, never holds
        glibc's heap apart (a server's memory grew by half again in that slack and never came
        back), and its memory goes back to the system when it is evicted."""
        like = torch.empty_like
        if self.device.type == "cpu":
            try:
                like = host_memory.Arena(host_memory.Arena.room([t for state in states for t in state.tensors()])).like
            except OSError:
                # Out of mappings (vm.max_map_count: a model of tiny state with a pool of many
                # thousand blocks could cache that many prefixes): copies in the heap still serve.
                pass
        return [state.save(like) for state in states]

    def restore(self, slot: int, entry: int, take: bool = False) -> None:
        """Start the sequence in `slot` (released) from prefix cache entry `entry`, as if it had
        run the entry's positions: their whole blocks shared, a last partial block copied into one
        of its own (it will write its next positions there), every layer's own state copied.
        take: the entry is forgotten here, and its partial block, which nothing else holds,
        becomes the sequence's own without a copy (for when the pool has no block to copy it
        into)."""
        cached, bs = self.cached[entry], self.blocks.block_size
        whole = cached.length // bs
        if take:
            self.blocks.adopt(slot, cached.blocks)
            self.evict(entry)
        else:
            self.blocks.adopt(slot, cached.blocks[:whole])
            if cached.length % bs:
                self.blocks.grow(slot, cached.length)
                own, source = self.blocks.tables[slot].held[-1], cached.blocks[whole]
                for pool in self.pools:
                    pool.copy_block(own, source)
        for state, saved in zip(self.states[slot], cached.saved):
            state.load(saved)

    def evict(self, entry: int) -> None:
        """Forget prefix cache entry `entry`; blocks nothing else holds become free."""
        self.blocks.drop(self.cached.pop(entry).blocks)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free

    def blocks_needed(self, slot: int, end: int) -> int:
        """Blocks the sequence in `slot` lacks to hold positions up to `end`."""
        return self.blocks.needed(slot, end)

    def block_use(self) -> tuple[int, int, int]:
        """(blocks in the pool, blocks the sequences hold, blocks held by anything), a moment's
        view for metrics (read from any thread: not a locked one)."""
        held = len({b for table in self.blocks.tables for b in list(table.held)})
        return self.blocks.num_blocks, held, self.blocks.num_used

    def sole_holder_of_last_block(self, entry: int) -> bool:
        """Whether prefix cache entry `entry` ends inside a block that only it holds."""
        cached = self.cached[entry]
        return cached.length % self.blocks.block_size != 0 and self.blocks.holders[cached.blocks[-1]] == 1

    def frees_a_block(self, entry: int) -> bool:
        """Whether forgetting entry `entry` would free any block (one only it holds)."""
        return any(self.blocks.holders[b] == 1 for b in self.cached[entry].blocks)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the pool right now: the device's on CUDA/NPU, MemAvailable on a CPU. On a
    device that counts what torch's allocator holds unused (freed by this process, kept for
    reuse: the random weights' temporaries, say), which the driver counts as taken: torch gives
    it back and retries before an allocation fails."""
    if device.type in ("cuda", "npu"):
        backend = getattr(torch, device.type)
        return backend.mem_get_info(device)[0] + backend.memory_reserved(device) - backend.memory_allocated(device)
    return meminfo_bytes("MemAvailable")


def default_budget_bytes(device: torch.device, ranks_sharing: int) -> int:
    """DEFAULT_KV_FRACTION of the free memory, split between the ranks that share it."""
    return int(DEFAULT_KV_FRACTION * free_memory_bytes(device) / max(1, ranks_sharing))


def ranks_sharing_memory(device: torch.device, world: int) -> int:
    """How many ranks draw on this rank's memory: the host's ranks on a CPU, one on a device."""
    if device.type != "cpu":
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def pool_blocks(engine, gib: float | None = None) -> int:
    """The KV pool's size in blocks under a budget of `gib` GiB per rank (default
    DEFAULT_KV_FRACTION of the memory free now), the same on every rank: the fewest any rank
    can hold. Every rank calls it."""
    per_block = kv_block_bytes(engine.cfg, tp().world, engine.dtype.itemsize)
    if per_block == 0:
        # No full-attention layer: blocks cost nothing, and the pool is as big as it is asked.
        return 2**62
    if gib is not None:
        return int(gib * 2**30) // per_block
    budget = default_budget_bytes(engine.device, ranks_sharing_memory(engine.device, tp().world))
    return int(all_gather_cat(torch.tensor([budget // per_block], dtype=torch.float64)).min())


def prefix_cache_bytes(engine, kv_cache_gib: float | None, budget_blocks: int) -> int:
    """The prefix cache's budget for copies of sequence state: PREFIX_CACHE_FRACTION of the KV
    cache's budget (--kv-cache-gib, or the blocks the default budget holds, uncapped by the
    pool's size), or of the default share of the free memory for a model with no KV blocks."""
    per_block = kv_block_bytes(engine.cfg, tp().world, engine.dtype.itemsize)
    if per_block == 0:
        default = default_budget_bytes(engine.device, ranks_sharing_memory(engine.device, tp().world))
        return int(PREFIX_CACHE_FRACTION * (kv_cache_gib * 2**30 if kv_cache_gib else default))
    return int(PREFIX_CACHE_FRACTION * budget_blocks * per_block)

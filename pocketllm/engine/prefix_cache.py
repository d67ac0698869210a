"""Rank 0's index of the prefix cache: which token prefixes are cached (as engine entries: KV blocks
plus a copy of the Gated DeltaNet state after the prefix), found by a hash of the tokens, kept
least-recently-used first under a budget of entries.

The recurrent state exists only where a sequence has been, so a prefix is cached where one ended
up: where a finished request stopped (its prompt and tokens so far; a chat's next turn starts with
them), and at the end of each prompt chunk before the last (a long shared prompt). A lookup finds
the longest cached prefix of a request's tokens that leaves at least one token to run (its logits
choose the next token). Keys chain a hash over whole KV blocks of tokens, then the tokens of the
partial last block, so a lookup hashes the request's tokens once; a hit is confirmed token by
token."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Entry:
    id: int
    tokens: tuple[int, ...]
    chain: int  # the hash of its whole blocks of tokens

    @property
    def length(self) -> int:
        return len(self.tokens)


def chain_hashes(tokens, block_size: int, blocks: int) -> list[int]:
    """The hash of the first k whole blocks of tokens, for k = 0..blocks."""
    out = [0]
    for k in range(blocks):
        out.append(hash((out[-1], tuple(tokens[k * block_size : (k + 1) * block_size]))))
    return out


class PrefixCache:
    def __init__(self, max_entries: int, block_size: int):
        self.max_entries, self.block_size = max_entries, block_size
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._by_chain: dict[int, set[int]] = {}
        self._ids = itertools.count()
        self.hits = self.misses = self.hit_tokens = 0

    def lookup(self, tokens: list[int]) -> Entry | None:
        """The longest cached prefix of `tokens` shorter than all of them, marked as just used."""
        limit = len(tokens) - 1
        bs = self.block_size
        chains = chain_hashes(tokens, bs, limit // bs)
        for k in range(len(chains) - 1, -1, -1):
            found = [
                e for e in (self.entries[i] for i in self._by_chain.get(chains[k], ()))
                if e.length <= limit and e.length // bs == k and tuple(tokens[: e.length]) == e.tokens
            ]
            if found:
                best = max(found, key=lambda e: e.length)
                self.entries.move_to_end(best.id)
                return best
        return None

    def count(self, hit: Entry | None) -> None:
        """Count a request started from `hit` (None: from nothing cached)."""
        if hit is None:
            self.misses += 1
        else:
            self.hits += 1
            self.hit_tokens += hit.length

    def find(self, tokens: list[int]) -> Entry | None:
        """The entry of exactly these tokens, if cached."""
        chain = chain_hashes(tokens, self.block_size, len(tokens) // self.block_size)[-1]
        t = tuple(tokens)
        return next((self.entries[i] for i in self._by_chain.get(chain, ()) if self.entries[i].tokens == t), None)

    def add(self, tokens: list[int]) -> Entry:
        """A new entry for these tokens (the caller makes room first: full())."""
        chain = chain_hashes(tokens, self.block_size, len(tokens) // self.block_size)[-1]
        entry = Entry(next(self._ids), tuple(tokens), chain)
        self.entries[entry.id] = entry
        self._by_chain.setdefault(chain, set()).add(entry.id)
        return entry

    def touch(self, entry: Entry) -> None:
        self.entries.move_to_end(entry.id)

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.max_entries

    def remove(self, entry_id: int) -> None:
        entry = self.entries.pop(entry_id)
        ids = self._by_chain[entry.chain]
        ids.discard(entry_id)
        if not ids:
            del self._by_chain[entry.chain]

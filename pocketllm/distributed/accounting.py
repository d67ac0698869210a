"""Counts the TP all-reduces the engine issues, per site, so a pass can say how many it made."""

from __future__ import annotations

from collections import Counter

# The sites that end in an all-reduce: the vocab-parallel embedding and the three row-parallel
# projections (seed section 1).
SITES = ("embed", "mlp.down", "lin.out", "full.out")


class CollectiveCounter:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def add(self, site: str) -> None:
        self.calls[site] += 1

    def reset(self) -> None:
        self.calls.clear()

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def snapshot(self) -> dict[str, int]:
        return {site: self.calls[site] for site in SITES if self.calls[site]}


COUNTER = CollectiveCounter()

"""What rank 0 tells the other ranks before each pass, and what every rank then runs: the block and
prefix cache operations since the last pass, in order (free a slot's KV blocks, cache a prefix of
a slot's sequence, start a slot from a cached prefix, forget one), then the pass's spans (slot,
start position, ids), and whether it reads every row's logits (a request keeping its prompt's:
the head then runs over every row, and its collectives with it, on every rank). Rank 0 runs each
operation as it decides it and sends them with the next pass; run in the same order on every
rank, they leave every rank's blocks, tables and cache entries alike."""

from __future__ import annotations

import torch

from pocketllm.distributed.state import broadcast_
from pocketllm.engine.budgets import DEFAULT_PREFILL_BUDGET

CLOSE = -1
# Operations one plan carries; a step with more sends them over several plans.
MAX_OPS = 64
# The operations, each four int64s: (code, a, b, c).
RELEASE = 1  # (slot): free the KV blocks of the sequence in slot
SNAPSHOT = 2  # (slot, entry, length): cache the first `length` positions of slot's sequence as entry
RESTORE = 3  # (slot, entry, take): start slot's sequence from cached entry (take: and forget it)
EVICT = 4  # (entry): forget cached entry



def apply(engine, ops: list[tuple[int, int, int, int]]) -> None:
    for code, a, b, c in ops:
        if code == RELEASE:
            engine.slots.release(a)
        elif code == SNAPSHOT:
            engine.slots.snapshot(a, b, c)
        elif code == RESTORE:
            engine.slots.restore(a, b, bool(c))
        elif code == EVICT:
            engine.slots.evict(a)
        else:
            raise RuntimeError(f"unknown plan operation {code}")


class PassPlan:
    """One plan in the fixed-size int64 form rank 0 broadcasts: [spans, operations, every row's
    logits (0 or 1), then (code, a, b, c) per operation, then (slot, start, rows) per span, then
    every span's ids]. A step with more operations than MAX_OPS sends them over several plans, all
    but the last without spans. Host memory on every device: the group's CPU backend (gloo beside
    NCCL or HCCL) carries it, so a rank waiting for the next plan blocks on the host, as on a CPU,
    where a device buffer cost copies both ways each pass and, on NCCL, a wait that returns at once
    and a resident kernel spinning on the device."""

    def __init__(self, max_spans: int, max_rows: int):
        self.max_spans, self.max_ops = max_spans, MAX_OPS
        self._spans_at = 3 + 4 * MAX_OPS
        self._ids_at = self._spans_at + 3 * max_spans
        self.buf = torch.zeros(self._ids_at + max_rows, dtype=torch.long)

    def encode(self, ops: list, spans: list[tuple[int, int, list[int]]], all_logits: bool = False) -> None:
        head = [len(spans), len(ops), int(all_logits)] + [v for op in ops for v in op]
        self.buf[: len(head)] = torch.tensor(head, dtype=torch.long)
        triples = [v for slot, start, ids in spans for v in (slot, start, len(ids))]
        self.buf[self._spans_at : self._spans_at + len(triples)] = torch.tensor(triples, dtype=torch.long)
        ids = [t for _, _, chunk in spans for t in chunk]
        self.buf[self._ids_at : self._ids_at + len(ids)] = torch.tensor(ids, dtype=torch.long)

    def close(self) -> None:
        self.buf[0] = CLOSE

    def decode(self) -> tuple[list, list[tuple[int, int, torch.Tensor]], bool] | None:
        """(operations, spans, every row's logits), or None for the plan that ends the run."""
        values = self.buf
        n, m, all_logits = int(values[0]), int(values[1]), bool(values[2])
        if n == CLOSE:
            return None
        ops = [tuple(values[3 + 4 * i : 7 + 4 * i].tolist()) for i in range(m)]
        spans, pos = [], self._ids_at
        for i in range(n):
            slot, start, rows = (int(v) for v in values[self._spans_at + 3 * i : self._spans_at + 3 * i + 3])
            spans.append((slot, start, values[pos : pos + rows].clone()))
            pos += rows
        return ops, spans, all_logits

    def send(self, ops: list, spans: list, all_logits: bool = False) -> None:
        """Broadcast ops and spans (rank 0), over as many plans as the ops need."""
        while len(ops) > self.max_ops:
            self.encode(ops[: self.max_ops], [])
            broadcast_(self.buf)
            ops = ops[self.max_ops :]
        self.encode(ops, spans, all_logits)
        broadcast_(self.buf)


# Batch-invariant, a preempted sequence replays the tokens it had chosen as decode rows, at most
# this many rows a pass for all such sequences together (each is a span of its own in the pass).
REPLAY_ROWS = 64


def pass_plan_for(engine, max_running: int, prefill_budget: int) -> PassPlan:
    """The plan of a Scheduler of these sizes, on every rank alike: a span per running sequence
    and per replayed row; rows of the prompt chunks (the budget, or one chunk where that is more),
    of the decode rows and of the replayed rows."""
    rows = max(prefill_budget, engine.prefill_chunk) + max_running + REPLAY_ROWS
    return PassPlan(max_running + REPLAY_ROWS, rows)


def run_pass_plan(engine, ops: list, spans: list[tuple[int, int, torch.Tensor]], all_logits: bool = False) -> torch.Tensor | None:
    """What every rank runs for a plan: its operations in order, then the pass if it has spans (a
    span starting at position 0 begins a new sequence in its slot)."""
    apply(engine, ops)
    return engine.run_packed(spans, all_logits=all_logits) if spans else None


def follow(engine, max_running: int, max_len: int, prefill_budget: int = DEFAULT_PREFILL_BUDGET, kv_blocks: int | None = None) -> None:
    """The other ranks' side of a Scheduler made with the same sizes: run each plan rank 0
    broadcasts until it closes the run."""
    engine.reserve_slots(max_running, max_len, kv_blocks)
    plan = pass_plan_for(engine, max_running, prefill_budget)
    while True:
        broadcast_(plan.buf, idle=True)
        got = plan.decode()
        if got is None:
            return
        run_pass_plan(engine, *got)

"""Continuous batching: requests wait, are admitted into a free slot of the engine when the KV
blocks of their prompt fit in the pool, run together in packed passes, and leave their slot the
moment they finish, so the next waiting request can take it between two passes.

The rule for what a pass carries: every running sequence in admission order, each with either
its next decode row (its prompt is all in) or its next prompt chunk, prompt chunks taking no more
than `prefill_budget` rows of the pass in all. So decode steps and prefill share passes, no
running sequence misses a pass while another's prompt is read, and a prompt longer than the
budget is read over several passes.

KV memory on demand: a sequence takes KV blocks as its positions are written. When the pool cannot
give the running sequences the blocks their next pass needs, the last admitted is preempted: its
blocks are freed and it waits again, first in line, to be recomputed from its prompt and the
tokens it has so far (then it goes on as if never stopped). No request fails for want of blocks.

Under TP, rank 0 schedules and samples; each pass's plan (slots to release, then slots, positions
and ids) goes to the other ranks in one broadcast of a fixed-size tensor, and they run the same
releases and the same pass (follow), so every rank's blocks are taken and freed alike."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pocketllm.distributed.state import broadcast_, tp
from pocketllm.engine.kv_blocks import blocks_for, pool_blocks
from pocketllm.engine.sampling import SamplingParams, choose
from pocketllm.inputs import prompt_problem

_CLOSE = -1
# An idle rank 0 sends an empty plan this often, so the other ranks' wait for the next pass never
# reaches the collective timeout however long no request comes.
KEEP_ALIVE_SECONDS = 1.0


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    output: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # a TokenLogprob per output token, when sampling.logprobs asks
    finished: bool = False
    finish_reason: str | None = None  # "stop" (a stop token), "length" (max_new_tokens), "cancelled"
    slot: int | None = None
    fed: int = 0  # positions of this sequence the engine has run
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()  # eos ids unless ignore_eos, and stop_token_ids
    preempted: int = 0  # times its blocks were taken back and it was recomputed

    @property
    def length(self) -> int:
        """Positions the sequence has: its prompt and the tokens chosen so far."""
        return len(self.prompt) + len(self.output)

    @property
    def prefilling(self) -> bool:
        """Its next rows are a chunk of what it already has (the prompt, or after a preemption
        the prompt and tokens so far), not a decode row."""
        return self.fed < max(len(self.prompt), self.length - 1)

    def _next_rows(self, budget: int) -> list[int]:
        """The ids this sequence feeds to its next pass: a chunk of its positions within
        `budget`, or its last token."""
        end = min(self.length, self.fed + budget) if self.prefilling else self.fed + 1
        n = len(self.prompt)
        return self.prompt[self.fed : min(end, n)] + self.output[max(self.fed - n, 0) : max(end - n, 0)]


class PassPlan:
    """What every rank does for one pass: the slots whose KV blocks to free first, then the spans
    (slot, start, ids), in the fixed-size int64 form rank 0 broadcasts: [spans, releases, then
    (slot, start, rows) per span, then the released slots, then every span's ids]."""

    def __init__(self, max_spans: int, max_rows: int, device):
        self.buf = torch.zeros(2 + 4 * max_spans + max_rows, dtype=torch.long, device=device)
        self.max_spans = max_spans
        # A slot is released at most once between two passes (a second release, with no pass
        # between to give it blocks, frees nothing): at most max_spans of them.
        self._ids_at = 2 + 4 * max_spans

    def encode(self, releases: list[int], spans: list[tuple[int, int, list[int]]]) -> None:
        head = [len(spans), len(releases)] + [v for slot, start, ids in spans for v in (slot, start, len(ids))]
        ids = [t for _, _, chunk in spans for t in chunk]
        self.buf[: len(head)] = torch.tensor(head, dtype=torch.long)
        at = 2 + 3 * self.max_spans
        self.buf[at : at + len(releases)] = torch.tensor(releases, dtype=torch.long)
        self.buf[self._ids_at : self._ids_at + len(ids)] = torch.tensor(ids, dtype=torch.long)

    def close(self) -> None:
        self.buf[0] = _CLOSE

    def decode(self) -> tuple[list[int], list[tuple[int, int, torch.Tensor]]] | None:
        """(releases, spans), or None for the plan that ends the run."""
        values = self.buf.cpu()
        n, r = int(values[0]), int(values[1])
        if n == _CLOSE:
            return None
        at = 2 + 3 * self.max_spans
        releases = values[at : at + r].tolist()
        spans, pos = [], self._ids_at
        for i in range(n):
            slot, start, rows = (int(v) for v in values[2 + 3 * i : 5 + 3 * i])
            spans.append((slot, start, values[pos : pos + rows].clone()))
            pos += rows
        return releases, spans


def run_plan(engine, releases: list[int], spans: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor | None:
    """What every rank runs for a plan: free the released slots' KV blocks, in order, then the pass
    (a span starting at position 0 begins a new sequence in its slot), if it has spans."""
    for slot in releases:
        engine.release(slot)
    return engine.run_packed(spans) if spans else None


@dataclass
class KVUsage:
    """The KV pool as /metrics reports it."""

    blocks_total: int
    blocks_used: int
    block_size: int
    preemptions: int


class Scheduler:
    """Rank 0's side: submit and cancel from any thread, step from one."""

    def __init__(self, engine, max_running: int, max_len: int, prefill_budget: int = 2048, kv_blocks: int | None = None):
        """kv_blocks: the KV pool's size in blocks (Engine.reserve_slots: default, and at most,
        what max_running sequences of max_len fill)."""
        if max_running < 1 or max_len < 1 or prefill_budget < 1:
            raise ValueError(f"max_running, max_len and prefill_budget must be >= 1, got {max_running}, {max_len}, {prefill_budget}")
        self.engine, self.max_running, self.max_len, self.prefill_budget = engine, max_running, max_len, prefill_budget
        self.vocab = engine.cfg.vocab_size
        engine.reserve_slots(max_running, max_len, kv_blocks)
        self.blocks = engine.blocks
        self.plan = PassPlan(max_running, prefill_budget + max_running, engine.device)
        self._released: list[int] = []  # slots freed since the last plan went out, in order
        self.preemptions = 0
        self.free_slots = list(range(max_running))
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._incoming: deque[Request] = deque()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.closed = False
        self._last_broadcast = time.monotonic()

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(), eos_ids=()) -> Request:
        """Queue a request; it runs from the next step on. ValueError (one line) for what cannot
        run: an empty prompt, a token id outside the vocab, more positions than a slot holds."""
        problem = prompt_problem(prompt, self.vocab)
        if problem:
            raise ValueError(problem)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens plus {max_new_tokens} new tokens is {len(prompt) + max_new_tokens}, "
                f"over the {self.max_len} positions a sequence may hold"
            )
        with self._lock:
            if self.closed:
                raise ValueError("the scheduler is closed")
            req = Request(next(self._ids), list(prompt), max_new_tokens, sampling, tuple(eos_ids))
            req.generator = torch.Generator().manual_seed(sampling.seed)
            req.stop_ids = sampling.stop_ids(req.eos_ids)
            self._incoming.append(req)
        return req

    def cancel(self, request: Request) -> None:
        """End `request` at the next step, freeing its slot; it ends with finish_reason
        "cancelled" unless it finished first."""
        with self._lock:
            self._cancelled.add(request.id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._incoming)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._incoming)

    def step(self) -> list[tuple[Request, int | None]]:
        """One pass (when any sequence is running): returns each request that got a token with
        it, and (request, None) for one that ended without a token."""
        events: list[tuple[Request, int | None]] = []
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            cancelled, self._cancelled = self._cancelled, set()
        if cancelled:
            for req in [r for r in self.waiting if r.id in cancelled]:
                self.waiting.remove(req)
                events.append((self._finish(req, "cancelled"), None))
            for req in [r for r in self.running if r.id in cancelled]:
                events.append((self._finish(req, "cancelled"), None))
        spans, fed = self._schedule(events)
        if not spans:
            return events
        self._broadcast(spans)
        logits = run_plan(self.engine, [], [(slot, start, torch.tensor(ids, dtype=torch.long)) for slot, start, ids in spans])
        greedy = torch.argmax(logits, dim=-1).tolist()
        for i, (req, (_, _, rows)) in enumerate(zip(fed, spans)):
            req.fed += len(rows)
            if req.fed < req.length:
                continue  # a chunk before the last: its logits choose nothing
            if req.sampling.plain_greedy:
                token = greedy[i]
            else:
                token, logprob = choose(logits[i], req.sampling, req.prompt, req.output, req.eos_ids, req.generator)
                if logprob is not None:
                    req.logprobs.append(logprob)
            req.output.append(token)
            events.append((req, token))
            if token in req.stop_ids:
                self._finish(req, "stop")
            elif len(req.output) >= req.max_new_tokens:
                self._finish(req, "length")
        return events

    def _schedule(self, events: list) -> tuple[list[tuple[int, int, list[int]]], list[Request]]:
        """This pass's spans and the requests they feed. The running sequences first, preempting
        the last admitted while the pool cannot give them the blocks their rows need; then, if
        none was preempted, waiting requests in order while a slot is free and the blocks of all
        they have (prompt, and tokens so far after a preemption) fit beside what the running
        ones still need for theirs."""
        preempted = False
        while True:
            spans, fed, budget = self._spans(self.running, self.prefill_budget)
            need = sum(self.blocks.needed(req.slot, req.fed + len(rows)) for req, (_, _, rows) in zip(fed, spans))
            if need <= self.blocks.num_free:
                break
            self._preempt(self.running[-1])
            preempted = True
        if preempted:
            return spans, fed
        room = self.blocks.num_free - sum(self.blocks.needed(req.slot, req.length) for req in self.running)
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.max_new_tokens == 0:
                self.waiting.popleft()
                events.append((self._finish(req, "length"), None))
                continue
            cost = blocks_for(req.length, self.blocks.block_size)
            if cost > room:
                break
            room -= cost
            self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            self.running.append(req)
            admitted.append(req)
        more, more_fed, _ = self._spans(admitted, budget)
        return spans + more, fed + more_fed

    @staticmethod
    def _spans(requests: list[Request], budget: int) -> tuple[list, list[Request], int]:
        """(slot, start, ids) for each request that feeds rows to this pass, prefill chunks taking
        at most `budget` rows in all; the requests; the budget left."""
        spans, fed = [], []
        for req in requests:
            prefilling = req.prefilling
            if prefilling and budget == 0:
                continue
            rows = req._next_rows(budget)
            if prefilling:
                budget -= len(rows)
            spans.append((req.slot, req.fed, rows))
            fed.append(req)
        return spans, fed, budget

    def _preempt(self, req: Request) -> None:
        """Take `req`'s blocks and slot back; it waits first in line, to be recomputed."""
        self.running.remove(req)
        self._release(req.slot)
        req.slot, req.fed = None, 0
        req.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, slot: int) -> None:
        self.engine.release(slot)
        self.free_slots.append(slot)
        if slot not in self._released:
            self._released.append(slot)

    def kv_usage(self) -> KVUsage:
        return KVUsage(self.blocks.num_blocks, self.blocks.num_used, self.blocks.block_size, self.preemptions)

    def keep_alive(self) -> None:
        """Call while idle (no step to run): tells the other ranks rank 0 is still there."""
        if time.monotonic() - self._last_broadcast >= KEEP_ALIVE_SECONDS:
            self._broadcast([])

    def _broadcast(self, spans: list) -> None:
        """Send the other ranks the plan: the slots released since the last one, and the spans."""
        released, self._released = self._released, []
        if tp().world > 1:
            self.plan.encode(released, spans)
            broadcast_(self.plan.buf)
            self._last_broadcast = time.monotonic()

    def _finish(self, req: Request, reason: str) -> Request:
        req.finished, req.finish_reason = True, reason
        if req.slot is not None:
            self.running.remove(req)
            self._release(req.slot)
            req.slot = None
        return req

    def close(self) -> None:
        """End the run for the other ranks (their follow returns). Requests still queued or
        running end as cancelled."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for req in list(self.running) + list(self.waiting) + list(self._incoming):
            self._finish(req, "cancelled")
        self.waiting.clear()
        self._incoming.clear()
        if tp().world > 1:
            self.plan.close()
            broadcast_(self.plan.buf)


def follow(engine, max_running: int, max_len: int, prefill_budget: int = 2048, kv_blocks: int | None = None) -> None:
    """The other ranks' side of a Scheduler made with the same sizes: run each plan rank 0
    broadcasts until it closes the run."""
    engine.reserve_slots(max_running, max_len, kv_blocks)
    plan = PassPlan(max_running, prefill_budget + max_running, engine.device)
    while True:
        broadcast_(plan.buf, idle=True)
        got = plan.decode()
        if got is None:
            return
        run_plan(engine, *got)


def generate_batch(engine, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(), eos_ids=(), max_running: int | None = None) -> list[list[int]]:
    """Every prompt's continuation, run as one batch (at most max_running at once); on ranks
    other than 0 it follows rank 0's passes and returns []."""
    max_running = min(max_running or len(prompts), len(prompts))
    max_len = max(len(p) for p in prompts) + max_new_tokens
    # The pool: what max_running sequences of max_len fill, or the default budget if smaller.
    kv_blocks = pool_blocks(engine)
    if tp().rank != 0:
        follow(engine, max_running, max_len, kv_blocks=kv_blocks)
        return []
    sched = Scheduler(engine, max_running, max_len, kv_blocks=kv_blocks)
    try:
        requests = [sched.submit(p, max_new_tokens, sampling, eos_ids) for p in prompts]
        while sched.has_work:
            sched.step()
    finally:
        sched.close()
    return [r.output for r in requests]

"""Continuous batching: requests wait, are admitted into a free slot of the engine, run together
in packed passes, and leave their slot the moment they finish, so the next waiting request can
take it between two passes.

The rule for what a pass carries: every running sequence in admission order, each with either
its next decode row (its prompt is all in) or its next prompt chunk, prompt chunks taking no more
than `prefill_budget` rows of the pass in all. So decode steps and prefill share passes, no
running sequence misses a pass while another's prompt is read, and a prompt longer than the
budget is read over several passes.

Under TP, rank 0 schedules and samples; each pass's plan (slots, positions, ids) goes to the other
ranks in one broadcast of a fixed-size tensor, and they run the same pass (follow)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pocketllm.distributed.state import broadcast_, tp
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

    def _next_rows(self, budget: int) -> list[int]:
        """The ids this sequence feeds to its next pass: a prompt chunk within `budget`, or its
        last token."""
        if self.fed < len(self.prompt):
            return self.prompt[self.fed : self.fed + budget]
        return [self.output[-1]]


class PassPlan:
    """The spans of one pass, (slot, start, ids), in the fixed-size int64 form rank 0 broadcasts:
    [spans, then (slot, start, rows) per span, then every span's ids]."""

    def __init__(self, max_spans: int, max_rows: int, device):
        self.buf = torch.zeros(1 + 3 * max_spans + max_rows, dtype=torch.long, device=device)
        self.max_spans = max_spans

    def encode(self, spans: list[tuple[int, int, list[int]]]) -> None:
        head = [len(spans)] + [v for slot, start, ids in spans for v in (slot, start, len(ids))]
        ids = [t for _, _, chunk in spans for t in chunk]
        self.buf[: len(head)] = torch.tensor(head, dtype=torch.long)
        base = 1 + 3 * self.max_spans
        self.buf[base : base + len(ids)] = torch.tensor(ids, dtype=torch.long)

    def close(self) -> None:
        self.buf[0] = _CLOSE

    def decode(self) -> list[tuple[int, int, torch.Tensor]] | None:
        """The spans, or None for the plan that ends the run."""
        values = self.buf.cpu()
        n = int(values[0])
        if n == _CLOSE:
            return None
        spans, pos = [], 1 + 3 * self.max_spans
        for i in range(n):
            slot, start, rows = (int(v) for v in values[1 + 3 * i : 4 + 3 * i])
            spans.append((slot, start, values[pos : pos + rows].clone()))
            pos += rows
        return spans


def run_plan(engine, spans: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """The pass every rank runs for a plan (a span starting at position 0 begins a new sequence
    in its slot)."""
    return engine.run_packed(spans)


class Scheduler:
    """Rank 0's side: submit and cancel from any thread, step from one."""

    def __init__(self, engine, max_running: int, max_len: int, prefill_budget: int = 2048):
        if max_running < 1 or max_len < 1 or prefill_budget < 1:
            raise ValueError(f"max_running, max_len and prefill_budget must be >= 1, got {max_running}, {max_len}, {prefill_budget}")
        self.engine, self.max_running, self.max_len, self.prefill_budget = engine, max_running, max_len, prefill_budget
        self.vocab = engine.cfg.vocab_size
        engine.reserve_slots(max_running, max_len)
        self.plan = PassPlan(max_running, prefill_budget + max_running, engine.device)
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
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if req.max_new_tokens == 0:
                events.append((self._finish(req, "length"), None))
                continue
            req.slot = self.free_slots.pop(0)
            self.running.append(req)
        if not self.running:
            return events
        spans, fed, budget = [], [], self.prefill_budget
        for req in self.running:
            if req.fed < len(req.prompt) and budget == 0:
                continue
            rows = req._next_rows(budget)
            if req.fed < len(req.prompt):
                budget -= len(rows)
            spans.append((req.slot, req.fed, rows))
            fed.append(req)
        self._broadcast(spans)
        logits = run_plan(self.engine, [(slot, start, torch.tensor(ids, dtype=torch.long)) for slot, start, ids in spans])
        greedy = torch.argmax(logits, dim=-1).tolist()
        for i, (req, (_, _, rows)) in enumerate(zip(fed, spans)):
            req.fed += len(rows)
            if req.fed < len(req.prompt):
                continue  # a prompt chunk before the last: its logits choose nothing
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

    def keep_alive(self) -> None:
        """Call while idle (no step to run): tells the other ranks rank 0 is still there."""
        if time.monotonic() - self._last_broadcast >= KEEP_ALIVE_SECONDS:
            self._broadcast([])

    def _broadcast(self, spans: list) -> None:
        if tp().world > 1:
            self.plan.encode(spans)
            broadcast_(self.plan.buf)
            self._last_broadcast = time.monotonic()

    def _finish(self, req: Request, reason: str) -> Request:
        req.finished, req.finish_reason = True, reason
        if req.slot is not None:
            self.running.remove(req)
            self.free_slots.append(req.slot)
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


def follow(engine, max_running: int, max_len: int, prefill_budget: int = 2048) -> None:
    """The other ranks' side of a Scheduler made with the same sizes: run each pass rank 0
    broadcasts until it closes the run."""
    engine.reserve_slots(max_running, max_len)
    plan = PassPlan(max_running, prefill_budget + max_running, engine.device)
    while True:
        broadcast_(plan.buf, idle=True)
        spans = plan.decode()
        if spans is None:
            return
        if spans:
            run_plan(engine, spans)


def generate_batch(engine, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(), eos_ids=(), max_running: int | None = None) -> list[list[int]]:
    """Every prompt's continuation, run as one batch (at most max_running at once); on ranks
    other than 0 it follows rank 0's passes and returns []."""
    max_running = min(max_running or len(prompts), len(prompts))
    max_len = max(len(p) for p in prompts) + max_new_tokens
    if tp().rank != 0:
        follow(engine, max_running, max_len)
        return []
    sched = Scheduler(engine, max_running, max_len)
    try:
        requests = [sched.submit(p, max_new_tokens, sampling, eos_ids) for p in prompts]
        while sched.has_work:
            sched.step()
    finally:
        sched.close()
    return [r.output for r in requests]

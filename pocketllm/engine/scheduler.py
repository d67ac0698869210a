"""TEMPORARY sequential stand-in for issue 19's batched scheduler, with exactly the interface that
one will have, so that `pocketllm serve` runs end to end before it lands on main. It runs one
request at a time on the existing Engine and Sampler (pocketllm.engine.generate): what it returns
for a request is what generate() returns for it. To be replaced wholesale by main's
pocketllm/engine/scheduler.py when that is merged into this branch.

Rank 0 runs step(); every other rank runs follow(engine), which runs the pass rank 0 announces
before each step (a small pickled command over the process group)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pocketllm.distributed.state import tp
from pocketllm.engine.generate import Sampler, SamplingParams


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    output: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    cancel_asked: bool = False


class Scheduler:
    def __init__(self, engine, max_running: int, max_len: int):
        self.engine, self.max_running, self.max_len = engine, max_running, max_len
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._current: Request | None = None
        self._sampler: Sampler | None = None
        self._next_id = 0

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(), eos_ids=()) -> Request:
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.engine.cfg.vocab_size
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise ValueError(f"token id {t} at position {i} is outside the vocab [0, {vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens plus {max_new_tokens} new tokens is over max_len={self.max_len}")
        with self._lock:
            req = Request(self._next_id, list(prompt), max_new_tokens, sampling, tuple(eos_ids))
            self._next_id += 1
            self._waiting.append(req)
        return req

    def cancel(self, request: Request) -> None:
        with self._lock:
            request.cancel_asked = True

    @property
    def has_work(self) -> bool:
        with self._lock:
            return self._current is not None or bool(self._waiting)

    @property
    def num_running(self) -> int:
        return 0 if self._current is None else 1

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> list[tuple[Request, int | None]]:
        events: list[tuple[Request, int | None]] = []
        with self._lock:
            for req in [r for r in self._waiting if r.cancel_asked]:
                self._waiting.remove(req)
                _finish(req, "cancelled")
                events.append((req, None))
            if self._current is not None and self._current.cancel_asked:
                _finish(self._current, "cancelled")
                events.append((self._current, None))
                self._current = None
            new = self._current is None and bool(self._waiting)
            if new:
                self._current = self._waiting.popleft()
            req = self._current
        if req is None:
            # An idle step still reaches the other ranks, so their wait never runs into the
            # process group's timeout while the server has nothing to do.
            _announce(("idle",))
            return events
        if new:
            _announce(("prefill", req.prompt, len(req.prompt) + req.max_new_tokens, req.sampling))
            self.engine.start_sequence(len(req.prompt) + req.max_new_tokens)
            self._sampler = Sampler(req.sampling)
            logits = self.engine.prefill(torch.tensor(req.prompt, dtype=torch.long))
        else:
            _announce(("decode", req.output[-1]))
            logits = self.engine.decode(req.output[-1])
        token = self._sampler(logits)
        req.output.append(token)
        if token in req.eos_ids:
            _finish(req, "stop")
        elif len(req.output) == req.max_new_tokens:
            _finish(req, "length")
        events.append((req, token))
        if req.finished:
            with self._lock:
                self._current = None
        return events

    def close(self) -> None:
        _announce(("close",))


def _finish(req: Request, reason: str) -> None:
    req.finished, req.finish_reason = True, reason


def _announce(command: tuple) -> None:
    if tp().world > 1:
        dist.broadcast_object_list([command], src=0)


def follow(engine) -> None:
    sampler = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command[0] == "close":
            return
        if command[0] == "prefill":
            _, prompt, max_len, sampling = command
            engine.start_sequence(max_len)
            sampler = Sampler(sampling)
            sampler(engine.prefill(torch.tensor(prompt, dtype=torch.long)))
        elif command[0] == "decode":
            sampler(engine.decode(command[1]))

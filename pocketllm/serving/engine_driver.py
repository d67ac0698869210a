"""The engine process's side of `serve` (rank 0): one thread that reads what the HTTP process
asks (submit, cancel, stop) between passes, steps the scheduler, and sends each step's tokens back
in one message. No HTTP, tokenizer or JSON work runs in this process, so nothing takes the GIL
from the pass that a step blocks on.

Every accepted request ends with an event that says how (its finish reason, or the failure the
HTTP process is told of): none is silently dropped, whether it finished, was cancelled, the server
shut down, or the engine failed."""

from __future__ import annotations

import collections
import dataclasses
import os
import select
import socket
import statistics
import time

from pocketllm import rank_failures
from pocketllm.engine.sampling import PromptLogprobs
from pocketllm.errors import exception_line
from pocketllm.serving import wire

# With nothing to do the loop wakes this often to tell the other ranks rank 0 is still there
# (Scheduler.keep_alive), so their wait for the next pass never reaches the collective timeout.
IDLE_WAKE_S = 0.5


# The closing line's medians are over this many of the latest steps of each kind: a server runs for
# days, and a list of every step's time would grow all that while.
MEDIAN_OF_LAST = 4096


class StepTimes:
    """Steps of one kind: how many, their total time, and the latest ones for a median."""

    def __init__(self):
        self.count, self.total = 0, 0.0
        self.latest: collections.deque[float] = collections.deque(maxlen=MEDIAN_OF_LAST)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.latest.append(seconds)

    def __str__(self) -> str:
        median = f", median {1e3 * statistics.median(self.latest):.1f} ms" if self.count else ""
        return f"{self.count} steps, {self.total:.1f} s{median}"


def failure_line(exc: BaseException) -> str:
    """What the HTTP process tells every open request of a failed engine: a collective that timed
    out or lost a peer as the launcher words it for a rank (not the backend's own message, which
    names its C++ source lines), anything else as its type and first line."""
    kind = rank_failures.collective_failure(exc)
    if kind is not None:
        return f"rank 0: {rank_failures.collective_line(kind)}"
    return exception_line(exc)


class EngineDriver:
    def __init__(self, scheduler, link: socket.socket):
        self.scheduler, self.link = scheduler, link
        # A descriptor that becomes readable when a signal arrives (signal.set_wakeup_fd), so that
        # an idle wait ends at once; serve sets it once its signal handlers are in place.
        self.wake_fd: int | None = None
        self._receiver = wire.Receiver(link)
        self._requests: dict[int, object] = {}  # the HTTP process's id -> the scheduler's Request
        self._rid_of: dict[int, int] = {}  # the scheduler's Request.id -> the HTTP process's id
        self._cancelled_all: set[int] = set()
        self.stopping = False  # set by a signal handler (a flag only) or a STOP message
        self._told_stopping = False
        self.lost = False
        self.unusable: str | None = None
        self.steps = StepTimes()  # decode-only steps' times: schedule, the pass, sampling
        self.prompt_steps = StepTimes()  # the same for steps whose pass read prompt rows
        self.prompt_rows = 0  # rows those passes read beyond one per sequence
        self.between_s = 0.0  # time between steps while there was work: the link, the loop

    def request_stop(self) -> None:
        """Admit nothing more: every request is cancelled, the step that frees them runs and the
        scheduler closes. Safe in a signal handler."""
        self.stopping = True

    def run(self) -> None:
        """Serve until stopped; an engine failure is sent to the HTTP process, then raised."""
        ended = None  # when the last step ended, while there is work
        # /metrics reports the pool from the start.
        self._send((wire.EVENTS, [], self._gauges()))
        try:
            while True:
                busy = self.scheduler.has_work
                self._read(0.0 if busy else IDLE_WAKE_S)
                if self.stopping:
                    self._stop_all()
                    if not self.scheduler.has_work:
                        break
                elif not self.scheduler.has_work:
                    self.scheduler.keep_alive()
                    ended = None
                    continue
                begun = time.perf_counter()
                if ended is not None:
                    self.between_s += begun - ended
                events = self.scheduler.step()
                done = time.perf_counter()
                extra = self.scheduler.last_rows - self.scheduler.last_spans
                (self.prompt_steps if extra else self.steps).add(done - begun)
                self.prompt_rows += extra
                self._send_events(events)
                ended = done if self.scheduler.has_work else None
        except BaseException as exc:
            self._send((wire.FAILED, failure_line(exc)))
            raise
        self.scheduler.close()
        self._send((wire.CLOSED,))

    def summary(self) -> str:
        """Where the engine process's busy time went, for the line rank 0 prints at the end."""
        if not self.steps.count and not self.prompt_steps.count:
            return "engine: no step ran"
        return (f"engine: {self.steps} decoding only; {self.prompt_steps} reading prompts too "
                f"({self.prompt_rows} rows beyond one per sequence); {self.between_s:.2f} s between steps while busy "
                "(the link and the loop)")

    def _read(self, timeout: float) -> None:
        fds = [self.link] if self.wake_fd is None else [self.link, self.wake_fd]
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        if self.wake_fd is not None and self.wake_fd in ready:
            try:
                os.read(self.wake_fd, 512)
            except OSError:
                pass
        if self.link not in ready:
            return
        for message in self._receiver.read():
            self._handle(message)
        if self._receiver.eof and not self.lost:
            self.lost = True
            self.stopping = True

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == wire.SUBMIT:
            _, rid, prompt, max_tokens, sampling, eos_ids = message
            if self.stopping:
                self._send((wire.EVENTS, [(rid, None, "cancelled", None, None)], self._gauges()))
                return
            scores = PromptLogprobs(prompt, sampling.prompt_logprobs) if sampling.prompt_logprobs is not None else None
            try:
                request = self.scheduler.submit(prompt, max_tokens, sampling, eos_ids, prompt_logits=scores)
            except ValueError as exc:
                self._send((wire.REFUSED, rid, str(exc)))
                return
            self._requests[rid] = request
            self._rid_of[request.id] = rid
        elif kind == wire.CANCEL:
            request = self._requests.get(message[1])
            if request is not None:
                self.scheduler.cancel(request)
        elif kind == wire.STOP:
            self.stopping = True
        elif kind == wire.UNUSABLE:
            self.unusable = message[1]
            self.stopping = True

    def _stop_all(self) -> None:
        if not self._told_stopping:
            self._told_stopping = True
            self._send((wire.STOPPING,))
        for rid, request in self._requests.items():
            if rid not in self._cancelled_all:
                self._cancelled_all.add(rid)
                self.scheduler.cancel(request)

    def _send_events(self, events) -> None:
        out, failed = [], []
        for request, token in events:
            rid = self._rid_of.get(request.id)
            if rid is None:
                continue
            if request.finished:
                del self._requests[rid], self._rid_of[request.id]
                self._cancelled_all.discard(rid)
            if request.finish_reason == "error":
                failed.append((wire.REQUEST_FAILED, rid, request.error))
                continue
            # Read here, in the step that appended it.
            logprob = request.logprobs[-1] if token is not None and request.sampling.logprobs is not None else None
            finish = (request.finish_reason or "cancelled") if request.finished else None
            out.append((rid, token, finish, logprob, self._prompt_logprobs(request, token)))
        self._send((wire.EVENTS, out, self._gauges()))
        for message in failed:
            self._send(message)

    @staticmethod
    def _prompt_logprobs(request, token) -> list | None:
        """A request's prompt logprobs, on its first event once its prompt has run: the one with
        its first token, or its last where it asked for none (max_tokens 0, with echo)."""
        if request.prompt_logits is None:
            return None
        first = len(request.output) == 1 if token is not None else (request.finish_reason == "length" and not request.output)
        return request.prompt_logits.listed() if first else None

    def _gauges(self) -> tuple:
        s = self.scheduler
        return s.num_running, s.num_waiting, dataclasses.asdict(s.kv_usage())

    def _send(self, message: tuple) -> None:
        if self.lost:
            return
        try:
            wire.send(self.link, message)
        except OSError:
            self.lost = True
            self.stopping = True

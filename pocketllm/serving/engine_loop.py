"""The scheduler driven from one dedicated thread on rank 0, and each request's tokens handed to the
asyncio task that answers it. A step blocks for a whole pass on every rank, so it must never run on
the event loop; submit and cancel are the scheduler's thread-safe calls and run on the loop.

Every accepted request ends with an event that says how (its finish reason, or the error that
ended it): none is silently dropped, whether it finished, was cancelled, the server shut down, or
the engine failed."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from pocketllm.serving.errors import ApiError
from pocketllm.serving.metrics import Metrics

# With nothing to do the thread wakes this often to tell the other ranks rank 0 is still there
# (Scheduler.keep_alive), so their wait for the next pass never reaches the collective timeout.
IDLE_WAKE_S = 0.5


@dataclass
class Event:
    token: int | None  # None when the request ended without a token
    finish_reason: str | None  # set on the request's last event: stop, length or cancelled
    error: ApiError | None = None
    logprob: object = None  # the token's TokenLogprob, when the request asked for logprobs


class Sequence:
    """One accepted request as its handler sees it: events to await, and cancel()."""

    def __init__(self, loop: EngineLoop, request, queue: asyncio.Queue):
        self._loop, self.request, self._queue = loop, request, queue
        self.done = False

    async def next(self) -> Event:
        event = await self._queue.get()
        if event.finish_reason is not None or event.error is not None:
            self.done = True
        return event

    def cancel(self) -> None:
        """Free the request's slot at the next step (a no-op once it ended)."""
        if not self.done:
            self.done = True
            self._loop.cancel(self.request)


@dataclass(eq=False)
class _Sink:
    """Where one request's events go, and what the thread knows of it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: object
    arrived: float
    seen_token: bool = False
    cancelled_at_shutdown: bool = False


class EngineLoop:
    def __init__(self, scheduler, metrics: Metrics, on_failure=lambda: None):
        self.scheduler, self.metrics, self.on_failure = scheduler, metrics, on_failure
        self._lock = threading.Lock()
        self._sinks: dict[int, _Sink] = {}
        self._wake = threading.Event()
        self.stopping = False
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pocketllm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: list[int], max_tokens: int, sampling, eos_ids) -> Sequence:
        """Called on the event loop; a refused request raises ApiError."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.failure is not None:
                raise ApiError(500, f"the engine failed and the server is stopping: {self.failure}")
            if self.stopping:
                raise ApiError(503, "the server is shutting down and takes no new requests")
            try:
                request = self.scheduler.submit(prompt, max_tokens, sampling, eos_ids)
            except ValueError as exc:
                raise ApiError(400, str(exc), "prompt") from None
            self._sinks[request.id] = _Sink(loop, queue, request, time.monotonic())
        self.metrics.admitted(len(prompt))
        self._wake.set()
        return Sequence(self, request, queue)

    def cancel(self, request) -> None:
        self.scheduler.cancel(request)
        self._wake.set()

    def request_stop(self) -> None:
        """Admit nothing more; the thread cancels every request, runs the step that frees them and
        closes the scheduler. Safe in a signal handler: it only sets a flag, which the thread reads
        after each step, or within IDLE_WAKE_S when idle (a lock or an Event here could be held
        by the very code the signal interrupted)."""
        self.stopping = True

    def begin_shutdown(self) -> None:
        """request_stop, and wake the thread now."""
        self.request_stop()
        self._wake.set()

    def join(self, timeout: float) -> bool:
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                if self.stopping:
                    # Every pass through: a request admitted while the flag was being set is
                    # cancelled too.
                    self._cancel_all()
                    if not self.scheduler.has_work:
                        break
                elif not self.scheduler.has_work:
                    self._wake.wait(IDLE_WAKE_S)
                    self._wake.clear()
                    if not self.scheduler.has_work:
                        self.scheduler.keep_alive()
                        continue
                for request, token in self.scheduler.step():
                    self._deliver(request, token)
        except BaseException as exc:
            self.failure = exc
            self._fail_all(exc)
            self.on_failure()
            return
        self.scheduler.close()

    def _cancel_all(self) -> None:
        with self._lock:
            fresh = [sink.request for sink in self._sinks.values() if not sink.cancelled_at_shutdown]
            for sink in self._sinks.values():
                sink.cancelled_at_shutdown = True
        for request in fresh:
            self.scheduler.cancel(request)

    def _deliver(self, request, token: int | None) -> None:
        with self._lock:
            sink = self._sinks.get(request.id)
            if request.finished:
                self._sinks.pop(request.id, None)
        if token is not None:
            self.metrics.tokens(1)
        if request.finished:
            self.metrics.ended_with(request.finish_reason or "cancelled")
        if sink is None:
            return
        if token is not None and not sink.seen_token:
            sink.seen_token = True
            self.metrics.first_token(time.monotonic() - sink.arrived)
        # Read here, on the thread that appends it, in the same step as the token.
        logprob = request.logprobs[-1] if token is not None and request.sampling.logprobs is not None else None
        _put(sink, Event(token, request.finish_reason if request.finished else None, logprob=logprob))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        error = ApiError(500, f"the engine failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        for sink in sinks:
            self.metrics.ended_with("error")
            _put(sink, Event(None, None, error))


def _put(sink: _Sink, event: Event) -> None:
    try:
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, event)
    except RuntimeError:
        # The event loop already closed: nobody is left to answer.
        pass

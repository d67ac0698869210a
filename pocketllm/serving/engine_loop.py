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

# With nothing to do the thread still steps this often: a step reaches every rank, so a follower
# waiting for the next pass never sees the process group time out while the server is idle.
IDLE_STEP_S = 1.0


@dataclass
class Event:
    token: int | None  # None when the request ended without a token
    finish_reason: str | None  # set on the request's last event: stop, length or cancelled
    error: ApiError | None = None


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


class EngineLoop:
    def __init__(self, scheduler, metrics: Metrics, on_failure=lambda: None):
        self.scheduler, self.metrics, self.on_failure = scheduler, metrics, on_failure
        self._lock = threading.Lock()
        # request id -> [event loop, queue, arrival time, got a token yet, request]
        self._sinks: dict[int, list] = {}
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
            self._sinks[request.id] = [loop, queue, time.monotonic(), False, request]
        self.metrics.admitted(len(prompt))
        self._wake.set()
        return Sequence(self, request, queue)

    def cancel(self, request) -> None:
        self.scheduler.cancel(request)
        self._wake.set()

    def begin_shutdown(self) -> None:
        """Admit nothing more and cancel every request; the thread then closes the scheduler."""
        with self._lock:
            self.stopping = True
            pending = [sink[4] for sink in self._sinks.values()]
        for request in pending:
            self.scheduler.cancel(request)
        self._wake.set()

    def join(self, timeout: float) -> bool:
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not (self.stopping and not self.scheduler.has_work):
                if not self.scheduler.has_work:
                    self._wake.wait(IDLE_STEP_S)
                    self._wake.clear()
                for request, token in self.scheduler.step():
                    self._deliver(request, token)
        except BaseException as exc:
            self.failure = exc
            self._fail_all(exc)
            self.on_failure()
            return
        self.scheduler.close()

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
        loop, queue, arrived, seen, _ = sink
        if token is not None and not seen:
            sink[3] = True
            self.metrics.first_token(time.monotonic() - arrived)
        event = Event(token, request.finish_reason if request.finished else None)
        _put(loop, queue, event)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        error = ApiError(500, f"the engine failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        for loop, queue, *_ in sinks:
            self.metrics.ended_with("error")
            _put(loop, queue, Event(None, None, error))


def _put(loop, queue: asyncio.Queue, event: Event) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, event)
    except RuntimeError:
        # The event loop already closed: nobody is left to answer.
        pass

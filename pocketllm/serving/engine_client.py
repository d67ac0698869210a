"""The HTTP process's side of `serve`: requests sent to the engine process over the link
(wire.py), and each request's tokens handed to the asyncio task that answers it. One reader thread
takes the engine's messages off the link; submit and cancel are called on the event loop.

Every accepted request ends with an event that says how (its finish reason, or the error that
ended it): the engine process answers each one, and if it fails or its end of the link closes,
every request still open ends with a 500."""

from __future__ import annotations

import asyncio
import itertools
import select
import socket
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

from pocketllm.inputs import request_problem
from pocketllm.serving import wire
from pocketllm.serving.errors import ApiError
from pocketllm.serving.metrics import Metrics

# How often the reader thread looks for a stop asked by a signal handler (which only sets a flag).
STOP_POLL_S = 0.1


@dataclass
class Event:
    token: int | None  # None when the request ended without a token
    finish_reason: str | None  # set on the request's last event: stop, length or cancelled
    error: ApiError | None = None
    logprob: object = None  # the token's TokenLogprob, when the request asked for logprobs
    prompt_logprobs: list | None = None  # per prompt position (the first None), on the first event, when asked


class Sequence:
    """One accepted request as its handler sees it: events to await, answered() once its answer
    ends, and cancel().

    /metrics counts each request once, by the finish reason its answer gave, which only the
    handler knows (a stop string can end the text at the very token the engine ended on
    `length`): the handler says it (answered, or cancel with answered_as), and where it leaves
    without a word the engine's own reason is counted. Everything here, and the engine's final
    event arriving (_Sink.arrive), runs on the event loop, one at a time."""

    def __init__(self, client: EngineClient, rid: int, sampling, sink: _Sink):
        self._client, self.id, self.sampling, self._sink = client, rid, sampling, sink
        self.done = False

    async def next(self) -> Event:
        event = await self._sink.queue.get()
        if event.finish_reason is not None or event.error is not None:
            self.done = True
        return event

    def answered(self, reason: str) -> None:
        """The answer ended with finish reason `reason` (after its last event): counted."""
        self._sink.count(self._client.metrics, reason)

    def cancel(self, answered_as: str | None = None) -> None:
        """Free the request's slot at the engine's next step (a no-op once it ended).
        answered_as: the finish reason its answer gives (a stop string's "stop"), which /metrics
        then counts it as; None: it was cancelled (its client left), counted as the engine ends it."""
        sink = self._sink
        # The engine's last event may be here already (read or not): counted now, as answered.
        sink.count(self._client.metrics, answered_as or sink.final)
        if self.done:
            return
        self.done = True
        sink.answered_as = answered_as or "gone"
        self._client.cancel(self.id)


@dataclass(eq=False)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrived: float
    seen_token: bool = False
    # Set on the event loop: how the handler ended the answer ("gone": it left without one), the
    # engine's finish reason once its last event arrived, and whether /metrics counted it.
    answered_as: str | None = None
    final: str | None = None
    counted: bool = False

    def count(self, metrics: Metrics, reason: str | None) -> None:
        if reason is not None and not self.counted:
            self.counted = True
            metrics.ended_with(reason)

    def arrive(self, metrics: Metrics, event: Event) -> None:
        """On the event loop: the request's event; its last one is counted here when the handler
        already said how its answer ended, or left."""
        if event.finish_reason is not None:
            self.final = event.finish_reason
            if self.answered_as is not None:
                self.count(metrics, event.finish_reason if self.answered_as == "gone" else self.answered_as)
        self.queue.put_nowait(event)


class EngineClient:
    def __init__(self, link: socket.socket, metrics: Metrics, vocab: int, max_len: int, receiver: wire.Receiver | None = None):
        self.link, self.metrics, self.vocab, self.max_len = link, metrics, vocab, max_len
        self._receiver = receiver or wire.Receiver(link)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sinks: dict[int, _Sink] = {}
        self._ids = itertools.count()
        self.stopping = False
        self._stop_sent = False
        self.failure: str | None = None
        self.ended = threading.Event()  # it closed, failed or is gone: nothing more comes
        self.on_end = lambda: None  # called once the engine closed or failed: the server stops
        self.gauges = (0, 0, None)  # running, waiting, KV usage: as of the engine's last step
        self._thread = threading.Thread(target=self._run, name="pocketllm-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: list[int], max_tokens: int, sampling, eos_ids) -> Sequence:
        """Called on the event loop; a refused request raises ApiError."""
        self._refuse_if_ended()
        problem = request_problem(prompt, max_tokens, self.vocab, self.max_len)
        if problem:
            raise ApiError(400, problem, "prompt")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        # Checked again where the sink is registered, under the lock the reader thread ends the
        # open requests under: a failure or close between the two is either seen here or finds
        # this sink among those it ends (registered after, it would wait for ever).
        with self._lock:
            self._refuse_if_ended()
            rid = next(self._ids)
            self._sinks[rid] = sink
        self._send((wire.SUBMIT, rid, list(prompt), max_tokens, sampling, tuple(eos_ids)))
        self.metrics.admitted(len(prompt))
        return Sequence(self, rid, sampling, sink)

    def _refuse_if_ended(self) -> None:
        if self.failure is not None:
            raise ApiError(500, f"the engine failed and the server is stopping: {self.failure}")
        if self.stopping or self.ended.is_set():
            raise ApiError(503, "the server is shutting down and takes no new requests")

    def cancel(self, rid: int) -> None:
        self._send((wire.CANCEL, rid))

    def request_stop(self) -> None:
        """Admit nothing more and ask the engine to cancel every request and close. Safe in a
        signal handler: it only sets a flag, which the reader thread acts on."""
        self.stopping = True

    def tell_unusable(self, message: str) -> None:
        self._send((wire.UNUSABLE, message))

    def render_metrics(self) -> str:
        running, waiting, kv = self.gauges
        return self.metrics.render(running, waiting, None if kv is None else SimpleNamespace(**kv))

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                wire.send(self.link, message)
        except OSError:
            pass  # the engine process is gone; the reader thread sees the link close

    def _run(self) -> None:
        while not self._receiver.eof:
            if self.stopping and not self._stop_sent:
                self._stop_sent = True
                self._send((wire.STOP,))
            if not self._receiver.buffered:
                ready, _, _ = select.select([self.link], [], [], STOP_POLL_S)
                if not ready:
                    continue
            for message in self._receiver.read():
                self._handle(message)
        if not self.ended.is_set():
            self._fail_all("the engine process ended")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == wire.EVENTS:
            self.gauges = message[2]
            # One step's tokens counted at once (the rate's window holds one entry a step).
            tokens = sum(1 for _, token, *_ in message[1] if token is not None)
            if tokens:
                self.metrics.tokens(tokens)
            for rid, token, finish, logprob, prompt_logprobs in message[1]:
                self._deliver(rid, token, finish, logprob, prompt_logprobs)
        elif kind == wire.REFUSED:
            with self._lock:
                sink = self._sinks.pop(message[1], None)
            if sink is not None:
                _put(sink, Event(None, None, ApiError(400, message[2], "prompt")))
        elif kind == wire.REQUEST_FAILED:
            with self._lock:
                sink = self._sinks.pop(message[1], None)
            self.metrics.ended_with("error")
            if sink is not None:
                sink.counted = True
                _put(sink, Event(None, None, ApiError(500, f"the engine could not finish this request: {message[2]}")))
        elif kind == wire.STOPPING:
            self.stopping = True
        elif kind == wire.CLOSED:
            # The engine answered every request it read before closing: one still open was sent
            # after it stopped reading, and nothing would answer it.
            with self._lock:
                self.stopping = True
                left, self._sinks = list(self._sinks.values()), {}
            self._end()
            for sink in left:
                sink.counted = True
                self.metrics.ended_with("error")
                _put(sink, Event(None, None, ApiError(503, "the server is shutting down and takes no new requests")))
        elif kind == wire.FAILED:
            self._fail_all(message[1])

    def _end(self) -> None:
        if not self.ended.is_set():
            self.ended.set()
            self.on_end()

    def _deliver(self, rid: int, token: int | None, finish: str | None, logprob, prompt_logprobs=None) -> None:
        with self._lock:
            sink = self._sinks.get(rid) if finish is None else self._sinks.pop(rid, None)
        if sink is None:
            if finish is not None:
                self.metrics.ended_with(finish)
            return
        if token is not None and not sink.seen_token:
            sink.seen_token = True
            self.metrics.first_token(time.monotonic() - sink.arrived)
        event = Event(token, finish, logprob=logprob, prompt_logprobs=prompt_logprobs)
        try:
            sink.loop.call_soon_threadsafe(sink.arrive, self.metrics, event)
        except RuntimeError:
            # The event loop already closed, so nothing runs on it any more: counted here as it
            # would have been there (once, as the handler answered, or as the engine ended it).
            sink.arrive(self.metrics, event)

    def _fail_all(self, why: str) -> None:
        """Refuse what comes, stop the server, then end every open request with a 500 (in that
        order: a handler that sees its error sees the server stopping too)."""
        with self._lock:
            self.failure = why
            sinks, self._sinks = list(self._sinks.values()), {}
        self._end()
        error = ApiError(500, f"the engine failed: {why}")
        for sink in sinks:
            sink.counted = True
            self.metrics.ended_with("error")
            _put(sink, Event(None, None, error))


def _put(sink: _Sink, event: Event) -> None:
    try:
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, event)
    except RuntimeError:
        # The event loop already closed: nobody is left to answer.
        pass

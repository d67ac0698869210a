"""The link between `serve`'s two processes: the engine process (rank 0: the scheduler and its
passes) and the HTTP process (routes, tokenizer, JSON). Messages are tuples, pickled and framed by
their length, over a socket pair the engine process made and handed to the HTTP process it
started, so nothing else can write to it.

HTTP process to engine process: (SUBMIT, id, prompt, max_tokens, sampling, eos_ids), (CANCEL, id),
(STOP,), (UNUSABLE, message) when it cannot serve (the address taken).
Engine process to HTTP process: (SETTINGS, dict) first; then after each step (EVENTS, [(id,
token, finish_reason, logprob, prompt_logprobs)], (running, waiting, kv usage as a dict)), a
request's prompt_logprobs (one per prompt position, the first None) on its first event, when it
asked for them; (REFUSED, id, message);
(REQUEST_FAILED, id, message) for a request the engine ended alone on an error, the rest going on;
(STOPPING,) once it admits nothing more; (CLOSED,) once the scheduler closed; (FAILED, message)
when the engine failed."""

from __future__ import annotations

import pickle
import socket
import struct

SUBMIT, CANCEL, STOP, UNUSABLE = "submit", "cancel", "stop", "unusable"
SETTINGS, EVENTS, REFUSED, STOPPING, CLOSED, FAILED = "settings", "events", "refused", "stopping", "closed", "failed"
REQUEST_FAILED = "request_failed"

_HEADER = struct.Struct("<I")


def send(sock: socket.socket, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


class Receiver:
    """Whole messages out of what a socket delivers, however it splits them."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._ready: list[tuple] = []
        self.eof = False

    def read(self) -> list[tuple]:
        """The messages complete after one recv (which blocks unless select said the socket is
        readable); sets eof when the other end closed."""
        if not self._ready:
            self._recv()
        out, self._ready = self._ready, []
        return out

    @property
    def buffered(self) -> bool:
        """Whether whole messages wait here already (one() read more than the one it returned):
        a select on the socket would not say so."""
        return bool(self._ready)

    def one(self) -> tuple | None:
        """The next message, blocking; None at eof."""
        while not self._ready and not self.eof:
            self._recv()
        return self._ready.pop(0) if self._ready else None

    def _recv(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except InterruptedError:
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return
        self._buf += data
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + n:
                break
            self._ready.append(pickle.loads(bytes(self._buf[_HEADER.size : _HEADER.size + n])))
            del self._buf[: _HEADER.size + n]

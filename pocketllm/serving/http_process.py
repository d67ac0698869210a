"""The engine process's handling of the HTTP process: started with a fresh interpreter (nothing of
the engine's threads or memory inherited) and its end of a socket pair, given the settings, and
waited for when the server ends; killed if it outlives its grace."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager

from pocketllm.interrupts import STOPS
from pocketllm.serving import wire

# The most the HTTP process gets, once the engine closed or failed, to answer its open connections
# (server.GRACEFUL_SHUTDOWN_S) and exit.
HTTP_EXIT_S = 6.0


def start_http(settings: dict) -> tuple[subprocess.Popen, socket.socket]:
    """The HTTP process and the engine's end of the link. settings: what http_main reads."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pocketllm.serving.http_main", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    finally:
        theirs.close()
    wire.send(ours, (wire.SETTINGS, settings))
    return proc, ours


def end_http(proc: subprocess.Popen, link: socket.socket, grace: float = HTTP_EXIT_S) -> int | None:
    """Wait for the HTTP process to exit (it does once told the engine closed or failed, or once
    the link closes), killing it after `grace`. Its exit status."""
    try:
        rc = proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    link.close()
    return rc


@contextmanager
def stop_on_signals(request_stop):
    """SIGINT, SIGTERM and SIGHUP call request_stop (which only sets a flag), and wake the engine's idle
    wait through the descriptor given to the body; a second signal ends the process at once."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    os.set_blocking(r, False)
    seen: list[int] = []

    def on_signal(signum, _frame):
        seen.append(signum)
        if len(seen) > 1:
            # The HTTP process sees the link close and ends its open requests with a 500.
            os._exit(128 + signum)
        request_stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, *STOPS)}
    old_fd = signal.set_wakeup_fd(w)
    try:
        yield r
    finally:
        signal.set_wakeup_fd(old_fd)
        for s, h in old.items():
            signal.signal(s, h)
        os.close(r)
        os.close(w)

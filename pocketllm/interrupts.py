"""SIGTERM taken as an interruption for a stretch of a command: where leaving something behind
would need a person to clean up (a half-written checkpoint, the rendezvous file a hand-started rank 0
holds for its whole run), `kill` then unwinds as Ctrl-C does, through the cleanup, and the command
ends with `pocketllm: interrupted` instead of dying where it stands."""

from __future__ import annotations

import contextlib
import signal
import threading


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts():
    """Within the block SIGTERM raises KeyboardInterrupt (in the main thread, the only one a
    handler can be set from; elsewhere nothing changes); the handler before is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)

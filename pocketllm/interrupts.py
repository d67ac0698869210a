"""SIGTERM (and SIGHUP: the terminal closed, an ssh session dropped) taken as an interruption for
a stretch of a command: where leaving something behind would need a person to clean up (a
half-written checkpoint, the rendezvous file a hand-started rank 0 holds for its whole run), `kill`
then unwinds as Ctrl-C does, through the cleanup, and the command ends with `pocketllm:
interrupted` instead of dying where it stands."""

from __future__ import annotations

import contextlib
import signal
import threading


# The signals that ask a process to stop, besides Ctrl-C's SIGINT.
STOPS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts():
    """Within the block SIGTERM and SIGHUP raise KeyboardInterrupt (in the main thread, the only
    one a handler can be set from; elsewhere nothing changes); the handlers before are restored
    after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _interrupt) for s in STOPS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)

"""A reader of the output that went away (`pocketllm generate ... | head`): the command ends
quietly with the status a shell gives a process SIGPIPE ended, as a program that dies of SIGPIPE
would, rather than with a traceback of the broken pipe. Python ignores SIGPIPE, so the write raises
BrokenPipeError instead; only one whose stdout has lost its reader is taken so (a socket's is not)."""

from __future__ import annotations

import os
import select
import signal

EXIT_STATUS = 128 + signal.SIGPIPE


def stdout_gone(exc: BaseException) -> bool:
    """Whether exc is a broken pipe and stdout has no reader any more (poll reports an error on the
    writing end of a pipe whose readers all closed it)."""
    if not isinstance(exc, BrokenPipeError):
        return False
    try:
        poll = select.poll()
        poll.register(1, 0)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):
        return False


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that what is still buffered and the flush at exit go nowhere
    rather than raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)

"""A reader of the output that went away (`pocketllm generate ... | head`): the command ends
quietly with the status a shell gives a process SIGPIPE ended, as a program that dies of SIGPIPE
would, rather than with a traceback of the broken pipe. Python ignores SIGPIPE, so the write raises
BrokenPipeError instead; only one whose stdout has lost its reader is taken so (a socket's is not).

Any other failed write of the results (`> file` on a full disk, text a stdout's encoding cannot
hold) is one line naming it (StdoutError, through guard_stdout), not a traceback."""

from __future__ import annotations

import os
import select
import signal
import sys

from pocketllm.errors import UsageError

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


class StdoutError(UsageError):
    """The results could not be written to stdout."""


class _GuardedStdout:
    """sys.stdout with its failed writes (but a lost reader's) raised as StdoutError; stdout is
    pointed at /dev/null then, so that the flush at exit does not fail again."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            quiet_stdout()
            raise StdoutError(f"cannot write the results to stdout ({exc.strerror or exc})") from None
        except UnicodeEncodeError as exc:
            # Nothing of the failed write reached the stream: what came before it stays.
            raise StdoutError(
                f"cannot write the results to stdout: its encoding, {exc.encoding}, has no {exc.object[exc.start:exc.end]!r} "
                "(PYTHONIOENCODING=utf-8 gives it one)"
            ) from None

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard_stdout() -> None:
    """Install the guard on sys.stdout (once, at a process's entry)."""
    if sys.stdout is not None and not isinstance(sys.stdout, _GuardedStdout):
        sys.stdout = _GuardedStdout(sys.stdout)

"""Errors a user can cause. The CLI turns each into one line on stderr and exit code 2."""

import os


class UsageError(Exception):
    """A bad flag, input, config or checkpoint: reported in one line, exit code 2."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be loaded as asked: missing, corrupt, or not this model."""


def exception_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message's first line (the type alone for none)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def not_a_file(path) -> str:
    """Why `path` is no file to read, as words to follow its name ("" for a regular file, or a
    link to one): a directory, a FIFO (which would block a read) and a link to nothing each say
    what they are, not that nothing is there."""
    if os.path.isfile(path):
        return ""
    if os.path.islink(path) and not os.path.exists(path):
        return f"is a symbolic link to {os.readlink(path)}, which does not exist"
    if os.path.isdir(path):
        return "is a directory"
    return "is not a regular file" if os.path.exists(path) else "does not exist"

"""Errors a user can cause. The CLI turns each into one line on stderr and exit code 2."""


class UsageError(Exception):
    """A bad flag, input, config or checkpoint: reported in one line, exit code 2."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be loaded as asked: missing, corrupt, or not this model."""


def exception_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message's first line (the type alone for none)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__

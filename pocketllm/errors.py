"""Errors a user can cause. The CLI turns each into one line on stderr and exit code 2."""


class UsageError(Exception):
    """A bad flag, input, config or checkpoint: reported in one line, exit code 2."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be loaded as asked: missing, corrupt, or not this model."""

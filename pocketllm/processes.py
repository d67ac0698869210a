"""Whether a process is still there, for the files a process leaves behind it (a rendezvous file,
a launcher's private directory, a checkpoint's hidden work directory) that a later run may clear
once their writer is gone."""

from __future__ import annotations

import os


def alive(pid: int, others_count: bool = True) -> bool:
    """Whether a process has this pid. One of another user's counts only with others_count: a
    pid another user's process took means this user's writer is gone, but a file of unknown
    ownership is not ours to judge."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return others_count
    return True

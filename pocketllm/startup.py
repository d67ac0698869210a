"""Imports at a process's start without the cyclic garbage collector.

Importing torch and the engine creates a few hundred thousand objects that live as long as the
process, and Python's collector, run by allocation counts, walks all of them again at every full
collection: about a sixth of a tiny run's CPU time went to it, during its imports. In a process
pocketllm's entry started (`owned()`, called by cli.script), `importing()` pauses the collector
for the imports and then moves everything alive out of its reach for good (gc.freeze: a module's
objects are never garbage), so the collections of the run itself walk only what the run makes.
Every rank of every run, and each process the tests start, pays the start. Where pocketllm runs
inside another program's process (cli.main called from Python, as the tests do) the collector is
left alone: freezing would keep that program's pending garbage forever.

seconds_since_start() says how long ago the process started, for the figures that count from
there (bench's "ready" time: the 64-layer preset's start to its first timed pass)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

_owned = False


def owned() -> None:
    """This process is pocketllm's: its entry (cli.script) started it."""
    global _owned
    _owned = True


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """In a process pocketllm owns, run the block (imports) with the collector paused, then freeze
    what exists and resume it (only if it was on). Elsewhere, just the block."""
    if not _owned:
        yield
        return
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def stat_fields(pid: int | str = "self") -> list[str]:
    """A process's /proc/PID/stat from its state on (field 3 is [0]): the fields after the ")"
    that ends the command name, which may hold spaces. OSError where it cannot be read."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def seconds_since_start() -> float | None:
    """Seconds since this process started (the kernel's record of it, so the interpreter's own
    start and imports count), or None where /proc does not say."""
    try:
        # Field 22, starttime, in clock ticks after boot.
        started = int(stat_fields()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None

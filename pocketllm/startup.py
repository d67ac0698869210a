"""Imports at a process's start without the cyclic garbage collector.

Importing torch and the engine creates a few hundred thousand objects that live as long as the
process, and Python's collector, run by allocation counts, walks all of them again at every full
collection: about a sixth of a tiny run's CPU time went to it, during its imports. In a process
pocketllm's entry started (`owned()`, called by cli.script), `importing()` pauses the collector
for the imports and then moves everything alive out of its reach for good (gc.freeze: a module's
objects are never garbage), so the collections of the run itself walk only what the run makes.
Every rank of every run, and each process the tests start, pays the start. Where pocketllm runs
inside another program's process (cli.main called from Python, as the tests do) the collector is
left alone: freezing would keep that program's pending garbage forever."""

from __future__ import annotations

import contextlib
import gc
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

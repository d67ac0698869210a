"""Named scopes around the phases of a forward pass, and the recorder that times them.

The model calls `with scope(name, site):` around each phase. No recorder is installed unless a
profile is on and a pass is running, and then `scope` returns one shared do-nothing object: the
disabled cost is one function call and one global read, with no clock, no synchronisation and no
dict work.

A recorder keeps a stack of open scopes and charges each scope its exclusive time (its own
elapsed time minus its children's), so the exclusive times of a tree add up to its root's elapsed
time and never more. Inclusive time is kept too, counted once per outermost occurrence of a key,
so a scope nested in itself is not counted twice. Times are integer nanoseconds, so these sums are
exact.
"""

from __future__ import annotations

import time

# The scope that is the whole forward pass; shares are fractions of its inclusive time and
# its own exclusive time is reported as "other".
STACK = "STACK"
# Scopes whose spans are collectives: the trace puts them on their own track.
COLLECTIVE_SCOPES = ("tp_all_reduce", "tp_all_gather", "tp_wait", "tp_skew")


class _NullScope:
    """What `scope` returns when nothing records: a context manager that does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def settle(self, work, wait) -> None:
        pass

    def wait_for_peers(self) -> None:
        pass


NULL_SCOPE = _NullScope()
_recorder: ScopeRecorder | None = None


def scope(name: str, site: str | None = None):
    """A context manager timing `name` (at `site`, a sub-total of it) when a recorder is on."""
    recorder = _recorder
    if recorder is None:
        return NULL_SCOPE
    return _Scope(recorder, (name, site))


def recording() -> bool:
    """Whether a recorder is on (a pass that must run its scopes to be timed)."""
    return _recorder is not None


def install(recorder: ScopeRecorder | None) -> None:
    """Make `recorder` receive every scope from now on (None: scopes do nothing again)."""
    global _recorder
    _recorder = recorder


def installed() -> ScopeRecorder | None:
    return _recorder


def _no_sync() -> None:
    pass


class _Scope:
    __slots__ = ("recorder", "key")

    def __init__(self, recorder: ScopeRecorder, key: tuple[str, str | None]):
        self.recorder, self.key = recorder, key

    def __enter__(self):
        self.recorder.open(self.key)
        return self

    def __exit__(self, *exc) -> bool:
        self.recorder.close(self.key)
        return False

    def settle(self, work, wait) -> None:
        """Called with an async collective's work handle inside its scope: a synchronising
        recorder waits for it here with `wait` (the caller's, so that profiling needs nothing
        from distributed), and the scope's time is the collective's own."""
        if self.recorder.settle_collectives and work is not None:
            wait(work)

    def wait_for_peers(self) -> None:
        """Called inside a collective's scope before it starts. With skew split on, wait here for
        every rank to arrive and charge that to the child scope tp_skew, so the collective's own
        scope holds only the collective and not the time its peers were late."""
        align = self.recorder.align
        if align is not None:
            with _Scope(self.recorder, ("tp_skew", self.key[1])):
                align()


class ScopeRecorder:
    """Exclusive and inclusive nanoseconds and calls per (name, site) for one pass.

    sync: called on entry and exit of every scope (the device synchronize of a phase profile) or
    None (no synchronisation). keep_spans: also keep every span for a trace. align: a barrier
    across ranks, run before each collective to split off skew, or None. event: on a device
    without sync, a function recording a timing event on the compute stream; each open and close
    then logs an event instead of reading the host clock (which would time kernel launches, not
    kernels), and replay() accounts them once the device has caught up.
    """

    def __init__(self, sync=None, clock=time.perf_counter_ns, keep_spans: bool = False, align=None, event=None):
        self.sync = sync or _no_sync
        self.settle_collectives = sync is not None
        self.align = align
        self.clock = clock
        self.keep_spans = keep_spans
        self.event = event
        self.reset()

    def reset(self) -> None:
        # key -> [exclusive ns, inclusive ns, calls]
        self.stats: dict[tuple[str, str | None], list[int]] = {}
        # Open frames, innermost last: [key, start ns, children's ns].
        self.stack: list[list] = []
        self.open_count: dict[tuple[str, str | None], int] = {}
        # (name, site, start ns, end ns) per closed span, when kept.
        self.spans: list[tuple[str, str | None, int, int]] = []
        # With events: (opens, key, event) per open and close, in order, until replay().
        self.log: list[tuple[bool, tuple[str, str | None], object]] = []

    def replay(self, origin_event, origin_ns: int) -> None:
        """After the device has synchronised: account every logged open and close as though the
        clock had read origin_ns + the event's device time since origin_event."""
        log, self.log = self.log, []
        times = iter([origin_ns + round(origin_event.elapsed_time(ev) * 1e6) for _, _, ev in log])
        clock, event = self.clock, self.event
        self.clock, self.event = (lambda: next(times)), None
        try:
            for opens, key, _ in log:
                (self.open if opens else self.close)(key)
        finally:
            self.clock, self.event = clock, event

    def open(self, key: tuple[str, str | None]) -> None:
        self.sync()
        if self.event is not None:
            self.log.append((True, key, self.event()))
            return
        self.open_count[key] = self.open_count.get(key, 0) + 1
        self.stack.append([key, self.clock(), 0])

    def close(self, key: tuple[str, str | None]) -> None:
        self.sync()
        if self.event is not None:
            self.log.append((False, key, self.event()))
            return
        end = self.clock()
        frame = self.stack.pop()
        if frame[0] != key:
            raise RuntimeError(f"scope {key} closed while {frame[0]} is the innermost open scope")
        elapsed = end - frame[1]
        entry = self.stats.get(key)
        if entry is None:
            entry = self.stats[key] = [0, 0, 0]
        entry[0] += elapsed - frame[2]
        entry[2] += 1
        remaining = self.open_count[key] - 1
        self.open_count[key] = remaining
        if remaining == 0:
            entry[1] += elapsed
        if self.stack:
            self.stack[-1][2] += elapsed
        if self.keep_spans:
            self.spans.append((key[0], key[1], frame[1], end))

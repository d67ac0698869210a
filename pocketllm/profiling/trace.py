"""A Chrome / Perfetto trace of the host spans, one JSON file per rank.

The Trace Event Format's "X" (complete) events, one process per rank and two threads in it:
compute (the pass and every non-collective span, nested as they ran) and collectives (every
all-reduce, all-gather and wait), so a collective is never drawn inside the compute span that
happened to issue it. ui.perfetto.dev and chrome://tracing both load the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from pocketllm.profiling.scopes import COLLECTIVE_SCOPES

COMPUTE_TID, COLLECTIVE_TID = 0, 1
# A cap on events per rank so a long generation cannot fill memory; the trace says when hit.
MAX_EVENTS = 2_000_000


class TraceWriter:
    """Timestamps keep perf_counter's own epoch (CLOCK_MONOTONIC on Linux, shared by every process
    on a host), so the ranks' files line up when their traceEvents are concatenated into one."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []
        self.dropped = 0

    @staticmethod
    def _us(ns: int) -> float:
        return ns / 1000.0

    def _event(self, name: str, tid: int, start_ns: int, end_ns: int, args: dict | None = None) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        ts = self._us(start_ns)
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": tid, "ts": ts, "dur": self._us(end_ns) - ts}
        if args:
            event["args"] = args
        self.events.append(event)

    def add_pass(self, block: dict, start_ns: int, end_ns: int, spans) -> None:
        """The pass as one span on the compute track, and its scopes' spans inside it."""
        label = f"{block['kind']} block={block['block']} rows={block['rows']}"
        self._event(label, COMPUTE_TID, start_ns, end_ns, {k: block[k] for k in ("block", "kind", "rows", "timed", "slices", "path")})
        for name, site, s, e in spans:
            tid = COLLECTIVE_TID if name in COLLECTIVE_SCOPES else COMPUTE_TID
            self._event(name if site is None else f"{name}/{site}", tid, s, e)

    def document(self) -> dict:
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COLLECTIVE_TID, "args": {"name": "collectives"}},
        ]
        # Chrome draws same-track events by start time; parents first when starts tie.
        events = sorted(self.events, key=lambda e: (e["tid"], e["ts"], -e["dur"]))
        doc = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
        if self.dropped:
            doc["otherData"] = {"dropped_events": self.dropped}
        return doc

    def write(self, directory: Path) -> Path:
        path = directory / f"trace-rank{self.rank}.json"
        with open(path, "w") as f:
            json.dump(self.document(), f)
        return path

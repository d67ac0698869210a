"""The profiler as an Engine hook: which profiles are on, and one report block per pass.

Phase profile (POCKETLLM_PHASE_PROFILE=1 or --phase-profile): every scope synchronises the device on
entry and exit, so its seconds are device time; attribution is exclusive. Host profile
(POCKETLLM_HOST_PROFILE=1 or --host-profile): wall clock, no synchronisation, nested spans with
inclusive and self time, and a Chrome/Perfetto trace with --trace-out. On CUDA and Ascend the host
clock would time kernel launches, so there each scope records device events on the compute stream
instead, read after one synchronisation at the pass's end: the spans are device time, and a
collective's wait is the compute stream waiting on the communication stream. The scope recorder is
installed only while a pass runs, so nothing outside a pass is timed.

Under a phase profile a rank that reaches an all-reduce first waits there for the others, so the
all-reduce's seconds hold the ranks' skew as well as the collective; --split-skew puts a barrier in
front of each all-reduce and charges the wait to its own scope, tp_skew.

Blocks are kept in memory and written when the run ends (`close`), so formatting and writing a
report never lands inside the timed window of the next pass.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pocketllm.profiling.blocks import BlockId, host_block, host_text, phase_block, phase_text
from pocketllm.profiling.scopes import ScopeRecorder, install
from pocketllm.profiling.options import ProfileOptions
from pocketllm.profiling.trace import TraceWriter


def _write_stderr(text: str) -> None:
    """One write per block: ranks share stderr, and a single write keeps a block's lines together."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(text)
        return
    data = text.encode()
    while data:
        data = data[os.write(fd, data) :]


class PassProfiler:
    """Engine hook: before_pass starts the pass's recorder, after_pass turns it into blocks."""

    # It times the layers' scopes: every pass it watches runs them.
    watches_layers = True

    def __init__(self, options: ProfileOptions, rank: int, sync, device=None, event=None):
        self.options = options
        self.rank = rank
        self._sync = sync if options.phase else None
        # A host profile on a device times device events (event: DeviceInfo.timing_event), read
        # after one synchronisation at the pass's end; a phase profile synchronises every scope.
        self._event = event if not options.phase else None
        self._device_sync = sync
        align = _barrier(device) if options.split_skew else None
        self.recorder = ScopeRecorder(sync=self._sync, keep_spans=options.trace_out is not None, align=align, event=self._event)
        self._origin = None
        self.phase_blocks: list[dict] = []
        self.host_blocks: list[dict] = []
        self.trace = TraceWriter(rank) if options.trace_out is not None else None
        self._start = 0

    def path_of(self, info) -> str:
        if info.serial:
            return "serial"
        # A phase profile waits for each slice's collective inside its scope: it measures the
        # overlapped code path with the overlap itself taken away.
        return "overlapped-serialised" if self.options.phase else "overlapped"

    def before_pass(self, info) -> None:
        self.recorder.reset()
        if self._sync is not None:
            self._sync()
        self._start = self.recorder.clock()
        if self._event is not None:
            self._origin = self._event()
        install(self.recorder)

    def after_pass(self, info) -> None:
        if self._sync is not None:
            self._sync()
        if self._event is not None:
            last = self._event()
            self._device_sync()
            end = self._start + round(self._origin.elapsed_time(last) * 1e6)
            self.recorder.replay(self._origin, self._start)
        else:
            end = self.recorder.clock()
        install(None)
        path = self.path_of(info)
        ident = BlockId(info.index, self.rank, info.kind, info.rows, info.timed, info.slices, path, dict(info.collectives or {}))
        wall = end - self._start
        stats = self.recorder.stats
        if self.options.phase:
            self.phase_blocks.append(phase_block(ident, stats, wall))
        if self.options.host:
            block = host_block(ident, stats, wall)
            self.host_blocks.append(block)
            if self.trace is not None:
                self.trace.add_pass(block, self._start, end, self.recorder.spans)

    def phase_block_for(self, index: int) -> dict | None:
        return next((b for b in self.phase_blocks if b["block"] == index), None)

    def close(self) -> None:
        """Write the run's blocks: text to stderr, JSON lines and traces to their directories."""
        install(None)
        o = self.options
        if o.phase_text:
            for block in self.phase_blocks:
                _write_stderr(phase_text(block))
        if o.host_text:
            for block in self.host_blocks:
                _write_stderr(host_text(block))
        if o.profile_out is not None:
            out = Path(o.profile_out)
            for kind, blocks in (("phase", self.phase_blocks), ("host", self.host_blocks)):
                if blocks:
                    with open(out / f"{kind}-rank{self.rank}.jsonl", "w") as f:
                        f.writelines(json.dumps(b) + "\n" for b in blocks)
        if self.trace is not None:
            self.trace.write(Path(o.trace_out))


def _barrier(device):
    """Every rank waits for the others: a one-element all-reduce on the compute device, which
    every backend runs (a gloo/NCCL/HCCL barrier would need backend-specific arguments)."""
    token = torch.zeros(1, device=device)

    def wait() -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(token)

    return wait


def attach_profiler(engine, options: ProfileOptions, rank: int, sync, event=None) -> PassProfiler | None:
    """Register a profiler on the engine when a profile is on; None (and no hook) otherwise.
    `event` records a device timing event (None on CPU, where an op is done when it returns)."""
    if not options.enabled:
        return None
    profiler = PassProfiler(options, rank, sync, engine.device, event)
    engine.hooks.append(profiler)
    return profiler


def profiler_of(engine) -> PassProfiler | None:
    return next((h for h in engine.hooks if isinstance(h, PassProfiler)), None)

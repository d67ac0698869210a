"""Where a pass's device time goes, kernel by kernel: `pocketllm bench --kernel-profile`.

After the timed run, one more prefill and the same decode steps run under torch.profiler, each
summed on its own: the wall time (device-synchronised, as the timed figures are), the time the
device spent running kernels, their count, and the kernels that took most of it. Busy time far
below the wall is a pass bound by its launches (Python issuing ops), not by its kernels; the top
kernels say which of them to make faster. The phase profile (--phase-profile) times the model's
phases with a synchronisation at each edge; this one does not stop the device, but recording
each op costs the host a few microseconds, so a pass that launches many small ops from Python
reads less busy here than in its timed run (a captured graph's replay, one launch, much less so):
the timed figures are the unprofiled ones.

On CUDA the rows are the device's kernels (and copies), timed by the device; their sum is the busy
time, which at TP>1 may pass the wall where a collective's kernels on their own stream overlap
the compute stream's. On a CPU they are torch's ops by their own time: pocketllm's compiled C
kernels are called from Python through ctypes, which the profiler does not see, so on a CPU they
are part of the wall's remainder."""

from __future__ import annotations

import os
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

# Rows of each table (the rest is summed into one row).
TOP = 12


@dataclass
class Table:
    """What one profiled phase spent: `rows` are (name, calls, milliseconds), largest first."""

    what: str
    wall_ms: float
    busy_ms: float
    calls: int
    rows: list[tuple[str, int, float]]

    def to_json(self) -> dict:
        return {"wall_ms": self.wall_ms, "busy_ms": self.busy_ms, "calls": self.calls, "top": [list(r) for r in self.rows]}


def supported(device_type: str) -> bool:
    return device_type in ("cpu", "cuda")


def profile(fn, device_type: str, sync) -> tuple[float, list[tuple[str, float]]]:
    """Run fn() under torch.profiler: its wall seconds (synchronised at both ends) and each timed
    event as (name, microseconds): the device's kernels on CUDA, torch's ops' own time on a CPU."""
    # Imported here: torch.profiler is not part of a rank's start-up.
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    # Kineto logs a line to stderr at each start and stop at any level below 6; read when the
    # profiler is first used. A user's own level stands.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    sync()
    with warnings.catch_warnings():
        # torch 2.11 warns at every profiler's start that events are cleared "at the end of each
        # cycle": of cycles of a schedule, which this one-cycle profile does not have.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        with torch_profile(activities=activities) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall = time.perf_counter() - t0
    if device_type == "cuda":
        events = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
        if not events:
            # Silenced above, kineto would have said why (most often CUPTI refused: no permission).
            raise RuntimeError("the profiler recorded no CUDA kernels (is CUPTI available to this process?)")
    else:
        # Each op's own time: an op called inside another counts in its own row, not twice.
        events = [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type == DeviceType.CPU and not e.is_user_annotation]
    return wall, events


def table(what: str, wall_s: float, events: list[tuple[str, float]], top: int = TOP) -> Table:
    """The events grouped by name, the `top` largest by time, the rest as one row."""
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, us in events:
        by_name[name][0] += 1
        by_name[name][1] += us / 1e3
    ranked = sorted(((n, c, ms) for n, (c, ms) in by_name.items()), key=lambda r: -r[2])
    rows = ranked[:top]
    if len(ranked) > top:
        rest = ranked[top:]
        rows.append((f"({len(rest)} others)", sum(r[1] for r in rest), sum(r[2] for r in rest)))
    return Table(what, wall_s * 1e3, sum(ms for _, _, ms in ranked), len(events), rows)


def describe(t: Table, device_type: str) -> list[str]:
    """The table as the lines bench prints."""
    unit = "kernels" if device_type == "cuda" else "torch ops"
    busy = "device busy" if device_type == "cuda" else "in torch's ops"
    share = t.busy_ms / t.wall_ms if t.wall_ms > 0 else 0.0
    lines = [f"kernel profile, {t.what}: wall {t.wall_ms:.2f} ms, {busy} {t.busy_ms:.2f} ms ({share:.0%}), {t.calls} {unit}"]
    if not t.rows:
        return lines
    lines.append(f"  {'ms':>9} {'share':>6} {'calls':>6}  {'kernel' if device_type == 'cuda' else 'op'}")
    for name, calls, ms in t.rows:
        lines.append(f"  {ms:9.3f} {ms / t.busy_ms if t.busy_ms else 0.0:6.1%} {calls:6d}  {name[:110]}")
    return lines

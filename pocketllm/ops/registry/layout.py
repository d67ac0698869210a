"""How a run holds its bf16 projection weights on a CPU: as loaded (rows) or in panels
(ops.gemv.panels). Chosen once at start, before the kernels are measured, and printed:
POCKETLLM_BF16_LAYOUT=rows|panels forces it; auto (the default) times both layouts' compiled
kernels (the registry's candidates named in TIMED) on the model's own weights, each shape its
share of 256 MiB: a pass of one row, a pass of eight rows, and 64 rows (a prompt's) over a cut.
Panels are taken only where a prompt's rows run no slower on them; then a run whose decode steps
hold one sequence takes the layout faster at one row, and a run of several sequences (bench
--batch, serve) the one whose one-row and eight-row passes take less time together. Which wins
depends on the CPU: panels pay where the row-major tiles are short of registers (AVX2), not where
the CPU has bf16 dot products (docs/batching.md, panels)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from pocketllm.errors import UsageError
from pocketllm.ops.gemv import panels
from pocketllm.ops.registry import cache, float_kinds, panel_kinds
from pocketllm.ops.registry.choose import machine_parts
from pocketllm.ops.registry.kinds import PANELS, Kind, all_kinds, forced_kernels
from pocketllm.ops.registry.trust import Monitor
from pocketllm.switches import ENV_BF16_LAYOUT as ENV
from pocketllm.switches import bf16_layout

# The bytes of weights timed, shared between their shapes (past the caches, as a step reads
# them).
PROBE_BYTES = 256 << 20
PASSES = 4
ROWS = 8
# A prompt's rows: timed on MANY_BYTES of the weights (the GEMM is bound by its arithmetic, so a
# cut is enough).
MANY_ROWS = 64
MANY_BYTES = 32 << 20
# What each layout is timed with at each row count: the registry's candidates of these names that
# can run here, the fastest counting. Row-major: the one-row GEMVs the registry prefers, the
# eight-row forms that read the weight once for all rows (blocked on AVX2, wide on AVX-512), and
# both GEMMs a prompt may take; panels: the one-row product as two streams a thread or one, and
# each tile its kind defaults to.
TIMED: dict[tuple[str, int], tuple[Kind, tuple[str, ...]]] = {
    ("rows", 1): (float_kinds.ONE_ROW, ("c-ahead", "c")),
    ("rows", ROWS): (float_kinds.FEW_ROW, ("c-blocked", "c-wide")),
    ("rows", MANY_ROWS): (float_kinds.MANY_ROW, ("mm", "c-f32")),
    ("panels", 1): (panel_kinds.ONE_ROW, ("c", "c-1")),
    ("panels", ROWS): (panel_kinds.FEW_ROW, ("c",)),
    ("panels", MANY_ROWS): (panel_kinds.MANY_ROW, ("c",)),
}
KEYS = tuple(f"{layout}-{rows}" for layout, rows in TIMED)


def _name(layout: str) -> str:
    return "in panels" if layout == "panels" else "as loaded (rows)"


@dataclass(frozen=True)
class LayoutChoice:
    """The layout for steps of one sequence (`layout`) and for steps of several (`batches`)."""

    layout: str  # "rows" or "panels"
    why: str
    batches: str = ""  # "" : the same as `layout`

    def for_rows(self, count: int) -> str:
        """The layout for a run whose decode steps hold up to `count` sequences."""
        return (self.batches or self.layout) if count > 1 else self.layout

    def describe(self, count: int = 1) -> str:
        held, batches = self.for_rows(count), self.batches or self.layout
        if batches == self.layout:
            return f"bf16 weights: {_name(held)} ({self.why})"
        return f"bf16 weights: {_name(held)} (for steps of one sequence {_name(self.layout)}, of several {_name(batches)}; {self.why})"


def _runnable(layout: str, rows: int) -> list[tuple[str, object]]:
    """TIMED's candidates for `layout` at `rows` rows that can run on this CPU: (name, kernel)."""
    kind, names = TIMED[(layout, rows)]
    fmt, cpu = ("bfloat16" if layout == "rows" else PANELS), torch.device("cpu")
    return [(n, kind.by_name[n].run) for n in names if not kind.by_name[n].unavailable(fmt, cpu)]


def _pass(kernel, weights, xs, outs) -> float:
    t0 = time.perf_counter()
    for w, x, out in zip(weights, xs, outs):
        kernel(x, w, out)
    return time.perf_counter() - t0


def probe_weights(weights: list[torch.Tensor], budget: int = PROBE_BYTES) -> list[torch.Tensor]:
    """What the layouts are timed on: every weight shape among `weights` (in step order) gets an
    equal share of `budget`, its weights taken in order until the share is spent, a weight bigger
    than the whole share cut to that many rows (a 27B head alone is ten times the budget, and the
    widest rows are where the layouts differ most)."""
    shapes = list(dict.fromkeys(tuple(w.shape) for w in weights))
    share = budget // max(1, len(shapes))
    taken = dict.fromkeys(shapes, 0)
    out = []
    for w in weights:
        s = tuple(w.shape)
        left = share - taken[s]
        if left <= 0:
            continue
        row_bytes = w.shape[1] * w.element_size()
        rows = min(w.shape[0], max(panels.PANEL, left // row_bytes // panels.PANEL * panels.PANEL))
        out.append(w if rows == w.shape[0] else w[:rows])
        taken[s] += rows * row_bytes
    return out


def _calls(weights, rows: int):
    lead = () if rows == 1 else (rows,)
    xs = {n: torch.randn(*lead, n, dtype=torch.bfloat16) for n in {w.shape[1] for w in weights}}
    return [xs[w.shape[1]] for w in weights], [torch.empty(*lead, w.shape[0], dtype=torch.bfloat16) for w in weights]


def measure(weights: list[torch.Tensor]) -> dict[str, float]:
    """Seconds for one pass over `weights` (and over their panels) at one row and at ROWS rows,
    and over probe_weights(weights, MANY_BYTES) at MANY_ROWS rows (a prompt's), by TIMED's
    kernels, each kernel's fastest of PASSES, the kernels alternated: keys KEYS ("rows-1",
    "panels-1", ...), each the fastest of its layout's kernels at that row count."""
    probe = {False: weights, True: probe_weights(weights, MANY_BYTES)}
    held = {(layout, many): ws if layout == "rows" else [panels.pack(w) for w in ws] for layout in ("rows", "panels") for many, ws in probe.items()}
    runs = {}
    for layout, rows in TIMED:
        ws = held[(layout, rows == MANY_ROWS)]
        for name, kernel in _runnable(layout, rows):
            runs[(f"{layout}-{rows}", name)] = (kernel, ws, *_calls(ws, rows))
    best = dict.fromkeys(runs, float("inf"))
    order = list(runs)
    for p in range(PASSES + 1):
        for key in order if p % 2 else reversed(order):
            s = _pass(*runs[key])
            if p:  # the first pass warms each up
                best[key] = min(best[key], s)
    return {k: min(s for (kk, _), s in best.items() if kk == k) for k in KEYS}


def cache_key(weights) -> str:
    """What a measurement depends on, as the kernel choices' keys name it: the CPU, torch and
    the builds it ran, the timed kernels (their names and sources), the threads and the weights'
    shapes in order."""
    parts = machine_parts(s for kind, names in TIMED.values() for n in names for s in kind.by_name[n].sources)
    timed = ",".join(f"{layout}-{rows}:{'/'.join(names)}" for (layout, rows), (_, names) in TIMED.items())
    shapes = ",".join(f"{w.shape[0]}x{w.shape[1]}" for w in weights)
    return "|".join(parts + ["bf16 layout", timed, f"{torch.get_num_threads()} threads", shapes])


def measured(weights, peers=()) -> tuple[dict[str, float], str]:
    """measure(weights), kept in the kernel choices' cache file so that every run on this machine
    (and every engine of one process) holds its weights alike, unless other processes or the
    host took the CPUs meanwhile (trust.Monitor; `peers`: the other ranks, measuring at the same
    time): the figures and how they came."""
    key = cache_key(weights)
    stored = cache.read().get(key)
    if isinstance(stored, dict) and set(stored) == set(KEYS):
        return {k: float(v) for k, v in stored.items()}, "cached"
    monitor = Monitor(peers)
    started = monitor.start()
    # Twice, each kernel's faster kept: a first measurement once read one kernel at half its
    # rate through all its passes (docs/batching.md, panels) and would have been kept.
    first, second = measure(weights), measure(weights)
    t = {k: min(first[k], second[k]) for k in first}
    verdict = monitor.stop(started)
    if verdict.disturbed:
        return t, f"measured, machine busy: not cached ({verdict.describe()})"
    cache.write({key: t})
    return t, "measured"


def choose_layout(weights, env=os.environ, peers=()) -> LayoutChoice:
    """The layout for the bf16 weights among `weights` (the model's projection weights in step
    order)."""
    want = bf16_layout(env)
    bf16 = [w for w in weights if panels.holds(w)]
    if not bf16:
        return LayoutChoice("rows", "no bf16 weight on a CPU")
    why = panels.unavailable()
    if want != "auto":
        if want == "panels" and why:
            raise UsageError(f"{ENV}=panels: {why}")
        return LayoutChoice(want, f"{ENV}={want}")
    if why:
        return LayoutChoice("rows", f"panels unavailable: {why}")
    forced = [k.setting for k in all_kinds() if k.family == "float" and k.setting in forced_kernels(env)]
    if forced:
        return LayoutChoice("rows", f"POCKETLLM_KERNELS forces {', '.join(forced)}, kernels of row-major weights")
    against = [name for rows in (1, ROWS) for name, _ in _runnable("rows", rows)]
    if len(against) < 2:
        return LayoutChoice("panels", "the row-major compiled kernels are unavailable")
    probe = probe_weights(bf16)
    total = sum(w.numel() * w.element_size() for w in probe)
    t, how = measured(probe, peers)
    # Panels only where a prompt's rows run no slower on them: on a CPU with bf16 arithmetic the
    # row-major GEMM is far ahead of an FMA tile.
    prompts = t[f"panels-{MANY_ROWS}"] <= t[f"rows-{MANY_ROWS}"]
    one = "panels" if prompts and t["panels-1"] < t["rows-1"] else "rows"
    batches = "panels" if prompts and t["panels-1"] + t[f"panels-{ROWS}"] < t["rows-1"] + t[f"rows-{ROWS}"] else "rows"
    ms = {k: f"{v * 1e3:.2f}" for k, v in t.items()}
    return LayoutChoice(
        one,
        batches=batches,
        why=f"{how} over {total / 2**20:.0f} MiB, panels against rows ({', '.join(against[:-1])} and {against[-1]}): "
        f"one row {ms['panels-1']} vs {ms['rows-1']} ms, {ROWS} rows {ms[f'panels-{ROWS}']} vs {ms[f'rows-{ROWS}']} ms, "
        f"{MANY_ROWS} rows over {MANY_BYTES >> 20} MiB {ms[f'panels-{MANY_ROWS}']} vs {ms[f'rows-{MANY_ROWS}']} ms; {ENV}=rows|panels forces",
    )

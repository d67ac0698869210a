"""How a run holds its bf16 projection weights on a CPU: as loaded (rows) or in panels
(ops.gemv.panels). Chosen once at start, before the kernels are measured, and printed:
POCKETLLM_BF16_LAYOUT=rows|panels forces it; auto (the default) times both layouts' kernels on
the model's own weights (each shape its share of 256 MiB): a pass of one row, a pass of eight
rows, and 64 rows (a prompt's) over a cut. Panels are taken only where a prompt's rows run no slower on them; then a run whose
decode steps hold one sequence takes the layout faster at one row, and a run of several sequences
(bench --batch, serve) the one whose one-row and eight-row passes take less time together. Which
wins depends on the CPU: panels pay where the row-major tiles are short of registers (AVX2), not
where the CPU has bf16 dot products (docs/batching.md, panels)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops import many_rows
from pocketllm.ops.gemv import kernels as rows_kernels
from pocketllm.ops.gemv import panels
from pocketllm.ops.registry import cache
from pocketllm.ops.registry.choose import TORCH_ISA_VARIABLES
from pocketllm.ops.registry.kinds import all_kinds, forced_kernels
from pocketllm.ops.registry.trust import Monitor
from pocketllm.switches import ENV_BF16_LAYOUT, bf16_layout

ENV = ENV_BF16_LAYOUT
# The bytes of weights timed, shared between their shapes (past the caches, as a step reads
# them).
PROBE_BYTES = 256 << 20
PASSES = 4
ROWS = 8
# A prompt's rows: timed on the first MANY_BYTES of the weights (the GEMM is bound by its
# arithmetic, so a cut is enough).
MANY_ROWS = 64
MANY_BYTES = 32 << 20
KEYS = ("rows-1", "panels-1", f"rows-{ROWS}", f"panels-{ROWS}", f"rows-{MANY_ROWS}", f"panels-{MANY_ROWS}")


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


def _bf16(weights) -> list[torch.Tensor]:
    return [w for w in weights if isinstance(w, torch.Tensor) and w.dtype is torch.bfloat16 and w.dim() == 2 and w.is_cpu]


def _rows_kernels() -> tuple[tuple[str, object], tuple[str, object]] | None:
    """The row-major compiled kernels panels are timed against: the one-row GEMV with its prefetch
    (the registry's first preference) and the few-row form this build has that reads the weight
    once for eight rows (blocked, else wide, else the four-row tile)."""
    if rows_kernels.compiled_unavailable("bfloat16", torch.device("cpu")):
        return None
    isa = rows_kernels.compiled_isa()
    if isa in rows_kernels.BLOCKED_BUILDS:
        few = ("c-blocked", rows_kernels.compiled_blocked_rows(rows_kernels.BLOCKED_X_BYTES, rows_kernels.BLOCKED_ROWS))
    elif 1 in rows_kernels.WIDE_ROWS.get(isa, ()):
        few = ("c-wide", rows_kernels.compiled_wide_rows(1, rows_kernels.WIDE_AHEAD_BYTES))
    else:
        few = ("c", rows_kernels.compiled_rows(0))
    return ("c-ahead", rows_kernels.compiled_gemv(0, rows_kernels.AHEAD_BYTES)), few


def _pass(kernel, weights, xs, outs) -> float:
    t0 = time.perf_counter()
    for w, x, out in zip(weights, xs, outs):
        kernel(x, w, out)
    return time.perf_counter() - t0


def _many_rows_kernels() -> list[tuple[str, object]]:
    """The row-major kernels a prompt's rows may run that panels are timed against: torch's GEMM,
    and the compiled fp32 tile where it is built (the registry's many-row candidates)."""
    out = [("mm", many_rows.mm)]
    if not many_rows.c_f32_unavailable("bfloat16", torch.device("cpu")):
        out.append(("c-f32", many_rows.c_f32))
    return out


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
    """Seconds for one pass over `weights` (and their panels) at one row and at ROWS rows, and
    over the first MANY_BYTES of them at MANY_ROWS rows (a prompt's), each kernel's fastest of
    PASSES, the kernels alternated: keys "rows-1", "panels-1", "rows-8", "panels-8", "rows-64",
    "panels-64" (rows-64: the faster row-major many-row kernel)."""
    (_, one), (_, few) = _rows_kernels()
    packed = [panels.pack(w) for w in weights]
    many, total = [], 0
    for w in weights:
        many.append(w)
        total += w.numel() * w.element_size()
        if total >= MANY_BYTES:
            break
    runs = {
        "rows-1": (one, weights, *_calls(weights, 1)),
        "panels-1": (panels.one_row(2), packed, *_calls(weights, 1)),
        "panels-1-1": (panels.one_row(1), packed, *_calls(weights, 1)),
        f"rows-{ROWS}": (few, weights, *_calls(weights, ROWS)),
        f"panels-{ROWS}": (panels.rows(4, 128), packed, *_calls(weights, ROWS)),
        f"panels-{MANY_ROWS}": (panels.rows(6, 128), packed[: len(many)], *_calls(many, MANY_ROWS)),
    }
    for name, kernel in _many_rows_kernels():
        runs[f"{name}-{MANY_ROWS}"] = (kernel, many, *_calls(many, MANY_ROWS))
    best = dict.fromkeys(runs, float("inf"))
    names = list(runs)
    for p in range(PASSES + 1):
        for name in names if p % 2 else reversed(names):
            s = _pass(*runs[name])
            if p:  # the first pass warms each up
                best[name] = min(best[name], s)
    best[f"rows-{MANY_ROWS}"] = min(best.pop(f"{name}-{MANY_ROWS}") for name, _ in _many_rows_kernels())
    # The panels' one row read as two streams a thread or one, whichever is faster (the registry
    # chooses per shape: two read faster over 1024-wide rows here, one over 5120-wide).
    best["panels-1"] = min(best["panels-1"], best.pop("panels-1-1"))
    return best


def cache_key(weights) -> str:
    """What a measurement depends on, as the kernel choices' keys name it: the CPU, torch and
    the builds it ran, both kernels' sources, the threads and the weights' shapes in order."""
    parts = [compiled.cpu_model(), f"torch {torch.__version__}"]
    parts += [f"{name}={os.environ[name]}" for name in TORCH_ISA_VARIABLES if os.environ.get(name)]
    parts += [f"{compiled.ENV_ISA}={compiled.isa()}"] if compiled.isa() != "native" else []
    parts += [f"kernels {compiled.source_digest(s)}" for s in (rows_kernels.SOURCE, panels.SOURCE)]
    shapes = ",".join(f"{w.shape[0]}x{w.shape[1]}" for w in weights)
    return "|".join(parts + ["bf16 layout", f"{torch.get_num_threads()} threads", shapes])


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
    bf16 = _bf16(weights)
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
    if _rows_kernels() is None:
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
        why=f"{how} over {total / 2**20:.0f} MiB, panels against rows ({' and '.join(n for n, _ in _rows_kernels())}): "
        f"one row {ms['panels-1']} vs {ms['rows-1']} ms, {ROWS} rows {ms[f'panels-{ROWS}']} vs {ms[f'rows-{ROWS}']} ms, "
        f"{MANY_ROWS} rows over the first {MANY_BYTES >> 20} MiB {ms[f'panels-{MANY_ROWS}']} vs {ms[f'rows-{MANY_ROWS}']} ms; {ENV}=rows|panels forces",
    )

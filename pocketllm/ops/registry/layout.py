"""How a run holds its bf16 projection weights on a CPU: as loaded (rows) or in panels
(ops.gemv.panels). Chosen once at start, before the kernels are measured, and printed:
POCKETLLM_BF16_LAYOUT=rows|panels forces it; auto (the default) times both layouts' compiled
kernels on the model's own first weights, a pass of one row and a pass of eight rows. A run whose
decode steps hold one sequence takes the layout faster at one row; a run of several sequences
(bench --batch, serve) the one whose two passes take less time together, a step of one sequence
and a step of eight weighing alike. Which wins depends on the CPU: panels pay where the
row-major tiles are short of registers (AVX2), not where the CPU has bf16 dot products
(docs/batching.md, panels)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops.gemv import kernels as rows_kernels
from pocketllm.ops.gemv import panels
from pocketllm.ops.registry import cache
from pocketllm.ops.registry.choose import TORCH_ISA_VARIABLES
from pocketllm.ops.registry.kinds import all_kinds, forced_kernels
from pocketllm.switches import env_value

ENV = "POCKETLLM_BF16_LAYOUT"
CHOICES = ("auto", "rows", "panels")
# The weights timed: the model's first, in step order, up to this many bytes (past the caches,
# as a step reads them).
PROBE_BYTES = 256 << 20
PASSES = 4
ROWS = 8


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


def requested(env=os.environ) -> str:
    value = env_value(env, ENV).strip() or "auto"
    if value not in CHOICES:
        raise UsageError(f"{ENV}={value!r}: use {', '.join(CHOICES)}")
    return value


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


def measure(weights: list[torch.Tensor]) -> dict[str, float]:
    """Seconds for one pass over `weights` (and their panels) at one row and at ROWS rows, each
    layout's fastest of PASSES, the layouts alternated: keys "rows-1", "panels-1", "rows-8",
    "panels-8"."""
    (_, one), (_, few) = _rows_kernels()
    packed = [panels.pack(w) for w in weights]
    x1 = {n: torch.randn(n, dtype=torch.bfloat16) for n in {w.shape[1] for w in weights}}
    x8 = {n: torch.randn(ROWS, n, dtype=torch.bfloat16) for n in x1}
    runs = {
        "rows-1": (one, weights, [x1[w.shape[1]] for w in weights], [torch.empty(w.shape[0], dtype=torch.bfloat16) for w in weights]),
        "panels-1": (panels.one_row(0), packed, [x1[w.shape[1]] for w in weights], [torch.empty(w.shape[0], dtype=torch.bfloat16) for w in weights]),
        "rows-8": (few, weights, [x8[w.shape[1]] for w in weights], [torch.empty(ROWS, w.shape[0], dtype=torch.bfloat16) for w in weights]),
        "panels-8": (panels.rows(4, 128), packed, [x8[w.shape[1]] for w in weights], [torch.empty(ROWS, w.shape[0], dtype=torch.bfloat16) for w in weights]),
    }
    best = dict.fromkeys(runs, float("inf"))
    names = list(runs)
    for p in range(PASSES + 1):
        for name in names if p % 2 else reversed(names):
            s = _pass(*runs[name])
            if p:  # the first pass warms each up
                best[name] = min(best[name], s)
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


def measured(weights) -> tuple[dict[str, float], str]:
    """measure(weights), kept in the kernel choices' cache file so that every run on this machine
    (and every engine of one process) holds its weights alike: the figures and how they came."""
    key = cache_key(weights)
    stored = cache.read().get(key)
    if isinstance(stored, dict) and set(stored) == {"rows-1", "panels-1", "rows-8", "panels-8"}:
        return {k: float(v) for k, v in stored.items()}, "cached"
    t = measure(weights)
    cache.write({key: t})
    return t, "measured"


def choose_layout(weights, env=os.environ) -> LayoutChoice:
    """The layout for the bf16 weights among `weights` (the model's projection weights in step
    order)."""
    want = requested(env)
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
    probe, total = [], 0
    for w in bf16:
        probe.append(w)
        total += w.numel() * w.element_size()
        if total >= PROBE_BYTES:
            break
    t, how = measured(probe)
    one = "panels" if t["panels-1"] < t["rows-1"] else "rows"
    batches = "panels" if t["panels-1"] + t["panels-8"] < t["rows-1"] + t["rows-8"] else "rows"
    ms = {k: f"{v * 1e3:.2f}" for k, v in t.items()}
    return LayoutChoice(
        one,
        batches=batches,
        why=f"{how} over {total / 2**20:.0f} MiB, panels against rows ({' and '.join(n for n, _ in _rows_kernels())}): "
        f"one row {ms['panels-1']} vs {ms['rows-1']} ms, "
        f"{ROWS} rows {ms['panels-8']} vs {ms['rows-8']} ms; {ENV}=rows|panels forces",
    )

"""Which one-row kernel runs each weight shape: measured on this machine, cached, or forced.

A decode step has a handful of distinct weight shapes. For each, every candidate kernel is timed
on the model's own weights in the order a step reads them, so each call finds its weight out of
cache as it does in a real step (a kernel timed on one hot weight would be timed on the cache,
not on memory). Passes alternate the candidates' order, and each kernel's fastest pass decides:
another process on a shared machine only ever adds time, so the minimum is what the kernel can
do, where a median taken in a busy spell could crown the kernel that happened to run in a quiet
one. The
result is cached per machine in a file keyed by CPU, torch version, dtype, threads and shape, so
the next load on the same machine only reads it. `POCKETLLM_GEMV=NAME` forces one kernel.

A decode step of several sequences has a few rows; its kernels are chosen the same way, for each
row count the engine asks for (the slots it reserves, rounded up to a power of two), among the
few-row candidates; `POCKETLLM_FEW_ROWS=NAME` forces one of those.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops import choice_cache
from pocketllm.ops.gemv import kernels
from pocketllm.ops.gemv.kernels import candidates_for, kernels_for

ENV_GEMV = "POCKETLLM_GEMV"
ENV_FEW_ROWS = "POCKETLLM_FEW_ROWS"
# Passes per candidate; even, so each candidate runs first as often as last.
PASSES = 6
# Enough weights per pass that the pass streams from memory, yet a 64-layer model is not read
# 24 times over at load: each shape's weights are taken in step order up to its share of this.
PASS_BYTES = 1 << 30
# Candidates this close to the fastest are a wash (pick).
WASH = 0.02
PREFERRED = {1: ("c", "c-prefetch"), 2: ("amx", "c", "c-prefetch")}
CACHE_FILE = "gemv.json"


def forced_kernel(env=os.environ, rows: int = 1) -> str | None:
    """POCKETLLM_GEMV (POCKETLLM_FEW_ROWS for rows > 1), checked: None for auto (unset, empty or
    "auto")."""
    name = ENV_GEMV if rows == 1 else ENV_FEW_ROWS
    candidates = candidates_for(rows)[0]
    value = env.get(name, "").strip()
    if value in ("", "auto"):
        return None
    if value not in candidates:
        what = "one-row" if rows == 1 else "few-row"
        raise UsageError(f"{name}={value!r} is not a {what} kernel: use auto, {', '.join(candidates)}")
    return value


def check_forced(dtype: torch.dtype, device_kind: str, env=os.environ) -> None:
    """A forced kernel this run cannot use is a usage error, before any rank starts."""
    for rows, var in ((1, ENV_GEMV), (2, ENV_FEW_ROWS)):
        name = forced_kernel(env, rows)
        if name is None:
            continue
        why = candidates_for(rows)[0][name].unavailable(dtype, torch.device(device_kind))
        if why:
            raise UsageError(f"{var}={name}: {why}")


@dataclass
class GemvChoice:
    """Kernel name per (out, in) weight shape, and how it was decided."""

    how: str  # "measured", "cached", "forced" or "default"
    by_shape: dict[tuple[int, int], str] = field(default_factory=dict)
    # Seconds per call of each candidate on each shape (its fastest pass), from the measurement
    # that made this choice.
    seconds: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)
    rows: int = 1  # the pass's rows the choice is for

    def describe(self) -> str:
        shapes = sorted(self.by_shape.items(), key=lambda kv: (-kv[0][0] * kv[0][1]))
        parts = ", ".join(f"{o}x{i} {name}" for (o, i), name in shapes)
        built = f"; c built for {kernels.compiled_isa()}" if {"c", "c-prefetch"} & set(self.by_shape.values()) else ""
        return f"{'one-row' if self.rows == 1 else f'{self.rows}-row'} kernels ({self.how}): {parts}{built}"

    def to_json(self) -> dict:
        return {
            "how": self.how,
            "rows": self.rows,
            "by_shape": {f"{o}x{i}": name for (o, i), name in self.by_shape.items()},
            "seconds": {f"{o}x{i}": s for (o, i), s in self.seconds.items()},
        }


def choose(weights: list[torch.Tensor], env=os.environ, rows: int = 1) -> GemvChoice:
    """The kernel for each shape among `weights` (the step's projection weights, in step order)
    for passes of `rows` rows."""
    shapes = sorted({tuple(w.shape) for w in weights})
    forced = forced_kernel(env, rows)
    if forced is not None:
        return GemvChoice("forced", dict.fromkeys(shapes, forced), rows=rows)
    if not weights:
        return GemvChoice("default", rows=rows)
    dtype, device = weights[0].dtype, weights[0].device
    candidates = [c.name for c in kernels_for(dtype, device, rows)]
    if len(candidates) == 1 or device.type != "cpu":
        return GemvChoice("default", dict.fromkeys(shapes, candidates_for(rows)[1]), rows=rows)
    keys = {s: _cache_key(s, dtype, rows) for s in shapes}
    cached = _read_cache()
    if all(k in cached and cached[k]["kernel"] in candidates for k in keys.values()):
        seconds = {s: cached[k]["seconds"] for s, k in keys.items()}
        return GemvChoice("cached", {s: pick(seconds[s], rows) for s in shapes}, seconds, rows)
    seconds = measure(weights, candidates, rows=rows)
    by_shape = {s: pick(seconds[s], rows) for s in shapes}
    _write_cache({keys[s]: {"kernel": by_shape[s], "seconds": seconds[s]} for s in shapes})
    return GemvChoice("measured", by_shape, seconds, rows)


def pick(seconds: dict[str, float], rows: int = 1) -> str:
    """The kernel to run from each candidate's measured seconds: the fastest, unless a compiled
    kernel is within WASH of it. Timed alone, torch's oneDNN calls and the compiled kernels can
    come out a fraction of a percent apart while a real step, with other work between them, runs
    the compiled ones faster (measured: docs/decode.md, near ties); so a wash goes to the kernel
    earlier in PREFERRED."""
    best = min(seconds.values())
    for name in PREFERRED[1 if rows == 1 else 2]:
        if name in seconds and seconds[name] <= best * (1 + WASH):
            return name
    return min(seconds, key=seconds.get)


def measure(weights: list[torch.Tensor], candidates: list[str], passes: int = PASSES, rows: int = 1) -> dict[tuple[int, int], dict[str, float]]:
    """Seconds per call of each candidate on each shape, its fastest of `passes` passes through
    `weights` (cut to PASS_BYTES) per candidate, the candidates' order reversed every other pass."""
    shapes = {tuple(w.shape) for w in weights}
    taken = dict.fromkeys(shapes, 0)
    chosen = []
    for w in weights:
        s = tuple(w.shape)
        # Every shape keeps at least one weight, and none more than its share of PASS_BYTES.
        if taken[s] == 0 or taken[s] < PASS_BYTES // len(shapes):
            chosen.append(w)
            taken[s] += w.numel() * w.element_size()
    lead = () if rows == 1 else (rows,)
    dtype, device = chosen[0].dtype, chosen[0].device
    inputs = {tuple(w.shape): torch.randn(*lead, w.shape[1], dtype=w.dtype, device=w.device) for w in chosen}
    outs = {s: torch.empty(*lead, s[0], dtype=dtype, device=device) for s in inputs}
    per_pass: dict[tuple[int, int], dict[str, list[float]]] = {s: {c: [] for c in candidates} for s in inputs}
    table = candidates_for(rows)[0]
    kernels = {c: table[c].run for c in candidates}
    # One untimed pass per candidate first: the first call of a kernel pays for its setup.
    for c in candidates:
        for w in chosen:
            kernels[c](inputs[tuple(w.shape)], w, outs[tuple(w.shape)])
    clock = time.perf_counter
    for p in range(passes):
        order = candidates if p % 2 == 0 else candidates[::-1]
        for c in order:
            run, sums = kernels[c], dict.fromkeys(inputs, 0.0)
            counts = dict.fromkeys(inputs, 0)
            for w in chosen:
                s = tuple(w.shape)
                t0 = clock()
                run(inputs[s], w, outs[s])
                sums[s] += clock() - t0
                counts[s] += 1
            for s in inputs:
                per_pass[s][c].append(sums[s] / counts[s])
    return {s: {c: min(v) for c, v in by_c.items()} for s, by_c in per_pass.items()}


def _cache_key(shape: tuple[int, int], dtype: torch.dtype, rows: int = 1) -> str:
    # The compiled kernels' source is part of the key: a choice measured against another version
    # of them says nothing about this one.
    parts = [
        compiled.cpu_model(), f"torch {torch.__version__}", f"kernels {compiled.source_digest(kernels.SOURCE)}",
        str(dtype).removeprefix("torch."), f"{torch.get_num_threads()} threads", f"{shape[0]}x{shape[1]}",
    ]
    return "|".join(parts + ([f"{rows} rows"] if rows > 1 else []))


def cache_path() -> str:
    return choice_cache.path(CACHE_FILE)


def _read_cache() -> dict:
    return choice_cache.read(CACHE_FILE)


def _write_cache(entries: dict) -> None:
    choice_cache.write(CACHE_FILE, entries)

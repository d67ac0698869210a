"""The unit `pocketllm calibrate` times on every rank: every row-parallel site of one repeat of the
model's layer pattern, in the pass's proportions, each the real overlapped projection (the
engine's kernels, the run's weight schemes) on random weights and activations, timed at rows x
slices points as the slowest rank saw them (pocketllm/commands/calibrate.py says why this unit)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from functools import reduce

import torch
import torch.distributed as dist

from pocketllm.config import LINEAR, ModelConfig
from pocketllm.distributed.allreduce_bench import max_over_ranks
from pocketllm.distributed.calibration import Point
from pocketllm.distributed.overlap import is_serial, projection_all_reduce_overlapped, slice_bounds
from pocketllm.distributed.state import group_pids, tp
from pocketllm.ops.quant.layout import quantize
from pocketllm.ops.registry import FEW_MAX, KernelSet

# Short passes are repeated inside one timing so that each timing covers at least this many rows;
# a 256-row unit is a few milliseconds, which a scheduler tick can double.
MIN_ROWS_PER_TIMING = 2048


@dataclass(frozen=True)
class Site:
    name: str
    in_local: int  # the GEMM's inner size on one rank
    count: int  # calls per timed unit


def row_parallel_sites(cfg: ModelConfig, world: int) -> list[Site]:
    """The row-parallel projections of one repeat of the layer pattern, with their per-rank shapes."""
    n_lin = sum(1 for t in cfg.layer_types if t == LINEAR)
    n_full = cfg.num_layers - n_lin
    counts = {"mlp.down": cfg.num_layers, "lin.out": n_lin, "full.out": n_full}
    g = reduce(math.gcd, [c for c in counts.values() if c])
    inner = {
        "mlp.down": cfg.intermediate_size,
        "lin.out": cfg.linear_value_dim,
        "full.out": cfg.num_attention_heads * cfg.head_dim,
    }
    return [Site(name, inner[name] // world, counts[name] // g) for name in counts if counts[name]]


def site_schemes(cfg: ModelConfig) -> dict:
    """The scheme each row-parallel site's weights run in (None: float), from the run's weight plan."""
    if cfg.weights is None:
        return {}
    linear = next((i for i, t in enumerate(cfg.layer_types) if t == LINEAR), None)
    full = next((i for i, t in enumerate(cfg.layer_types) if t != LINEAR), None)
    keys = {"mlp.down": "model.layers.0.mlp.down_proj.weight"}
    if linear is not None:
        keys["lin.out"] = f"model.layers.{linear}.linear_attn.out_proj.weight"
    if full is not None:
        keys["full.out"] = f"model.layers.{full}.self_attn.o_proj.weight"
    return {site: cfg.weights.scheme_for(key) for site, key in keys.items()}


class Unit:
    """The timed unit at every row count, on one rank: weights and activations allocated once."""

    def __init__(self, sites: list[Site], hidden: int, max_rows: int, dtype, device, schemes: dict | None = None):
        gen = torch.Generator().manual_seed(1234 + tp().rank)
        self.sites = sites
        self.weights = {s.name: (torch.randn(hidden, s.in_local, generator=gen) * s.in_local**-0.5).to(device, dtype) for s in sites}
        # Quantized as the run would hold them (schemes: site -> WeightScheme), so the points time
        # the projections that run.
        for name, scheme in (schemes or {}).items():
            if scheme is not None and device.type == "cpu":
                self.weights[name] = quantize(self.weights[name], scheme.kind, scheme.group, scheme.symmetric)
        self.inputs = {s.name: torch.randn(max_rows, s.in_local, generator=gen).to(device, dtype) for s in sites}
        self.kernels = KernelSet()
        self.projections = {name: self.kernels.bind(w) for name, w in self.weights.items()}

    def choose_kernels(self, rows_list: list[int]) -> str:
        """Choose (measured, or read from this machine's cache and checked) the kernels the engine
        runs these projections with, one-row, few-row and many-row, as the engine chooses them, and
        bind the projections to them, so the points time the engine's GEMMs and not torch's
        defaults (which on some CPUs are several times slower). Returns what was chosen, for rank
        0 to print."""
        weights = list(self.weights.values())
        self.kernels = KernelSet.choose(weights, peers=group_pids())
        few = [r for r in rows_list if 1 < r <= FEW_MAX]
        if few:
            self.kernels.choose_few(weights, max(few))
        self.projections = {name: self.kernels.bind(w) for name, w in self.weights.items()}
        return "; ".join(self.kernels.describe())

    def run(self, rows: int, slices: int) -> None:
        for s in self.sites:
            x, project = self.inputs[s.name][:rows], self.projections[s.name]
            for _ in range(s.count):
                projection_all_reduce_overlapped(x, project, slices, s.name)


def _timed_rows(rows: int) -> int:
    return rows * max(1, math.ceil(MIN_ROWS_PER_TIMING / rows))


def time_point(unit: Unit, rows: int, slices: int, device) -> float:
    """Seconds for one unit at (rows, slices), as the slowest rank saw it."""
    iters = _timed_rows(rows) // rows
    device.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        unit.run(rows, slices)
    device.synchronize()
    (seconds,) = max_over_ranks([(time.perf_counter() - t0) / iters])
    return seconds


def measure(unit: Unit, rows_list: list[int], pins: list[int], reps: int, device, progress) -> list[Point]:
    """Every point once per rep, reps outermost, so a slow patch of machine lands on every point.
    A slice count above a row count is not a point: those rows run serially (overlap.is_serial),
    which the point at one slice times. progress(total_rows, desc): the bar the rows timed are
    counted on."""
    order = [(r, s) for r in rows_list for s in pins if s == 1 or s <= r]
    for r, s in order:
        unit.run(r, s)
    times: dict[tuple[int, int], list[float]] = {p: [] for p in order}
    bar = progress(sum(_timed_rows(r) for r, _ in order) * reps, "calibrate")
    for rep in range(reps):
        for r, s in order:
            bar.set_description(f"rep {rep + 1}/{reps} rows={r} slices={s}")
            times[(r, s)].append(time_point(unit, r, s, device))
            bar.update(_timed_rows(r))
    bar.close()
    return [Point(r, s, statistics.median(times[(r, s)]), tuple(times[(r, s)])) for r, s in order]


def payload_sizes(rows_list: list[int], pins: list[int], hidden: int, elem: int) -> list[int]:
    """The slice payloads the calibrated points issue, for the all-reduce fit stored beside them:
    each slice's rows as overlap.slice_bounds cuts them (earlier slices take the remainder), and
    the whole rows where the projection runs serially (overlap.is_serial, on this rank's group)."""
    sizes = set()
    for r in rows_list:
        for s in pins:
            bounds = [(0, r)] if is_serial(r, s) else slice_bounds(r, s)
            sizes.update((end - start) * hidden * elem for start, end in bounds)
    return sorted(sizes)

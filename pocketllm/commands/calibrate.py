"""`pocketllm calibrate`: time the real overlapped projection at rows x slices points on this
machine and write the calibration file the calibrated slice policy is built from.

The timed unit is every row-parallel site of one repeat of the model's layer pattern, in the
pass's proportions: for the 3:1 hybrid, 4 mlp.down + 3 lin.out + 1 full.out. All three all-reduce
the same [rows, hidden] payload, but their GEMMs differ (mlp.down's inner size is intermediate/world,
3x lin.out's on the 27B shape), and the GEMM is what hides the collective, so timing mlp.down alone
would overstate what slicing buys at the other two sites while the policy picks one count for all.
Weights and activations are random: a GEMM's time does not depend on the values.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import reduce

import torch
import torch.distributed as dist

from pocketllm.commands.progress import row_progress
from pocketllm.commands.ranked import run_without_model
from pocketllm.commands.settings import DEFAULT_WORLD, model_free_run_plan, source_plan
from pocketllm.config import LINEAR, ModelConfig
from pocketllm.distributed import collective
from pocketllm.distributed.allreduce_bench import max_over_ranks, sweep_sizes
from pocketllm.distributed.calibration import Calibration, Point
from pocketllm.distributed.overlap import is_serial, projection_all_reduce_overlapped, slice_bounds
from pocketllm.distributed.policy import CalibratedPolicy, resolve_ceiling
from pocketllm.distributed.state import group_pids, tp
from pocketllm.errors import UsageError
from pocketllm.flags import parse_positive_list
from pocketllm.model_args import add_rank_args, add_source_args, check_out_path, model_plan, say
from pocketllm.ops.quant.layout import quantize
from pocketllm.ops.registry import FEW_MAX, KernelSet
from pocketllm.run_plan import RunPlan, SlicePlan

# Short passes are repeated inside one timing so that each timing covers at least this many rows;
# a 256-row unit is a few milliseconds, which a scheduler tick can double.
MIN_ROWS_PER_TIMING = 2048
ALLREDUCE_FIT_ITERS = 10


def add_arguments(p) -> None:
    # One rank has no all-reduce to calibrate: --tp-world defaults to 2, as for `allreduce`. The
    # command times every --pin count under no policy and profiles nothing, so it takes only the
    # rule's ceiling of the overlap flags (it shapes the choices printed).
    add_rank_args(p, default_world=DEFAULT_WORLD)
    add_source_args(p)
    p.add_argument("--comm-overlap-slices", help="the slice rule's ceiling for the choices printed (env POCKETLLM_COMM_OVERLAP_SLICES, alias QWEN_COMM_OVERLAP_SLICES, default 4)")
    p.add_argument("--rows", default="256,512,1024,2048,4096,8192", help="row counts to calibrate (default 256,512,1024,2048,4096,8192)")
    p.add_argument("--pin", default="1,2,4,8", help="slice counts to time at each row count (default 1,2,4,8)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, interleaved over every point (default 3)")
    p.add_argument("--out", required=True, help="the calibration file to write (JSON)")


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


@dataclass(frozen=True)
class Task:
    """calibrate's own settings in the run plan."""

    rows: str = "256,512,1024,2048,4096,8192"
    pin: str = "1,2,4,8"
    reps: int = 3
    out: str = ""


def _prepare(run):
    t = run.task
    rows = parse_positive_list(t.rows, "--rows")
    pins = parse_positive_list(t.pin, "--pin")
    if t.reps < 1:
        raise UsageError(f"--reps must be >= 1, got {t.reps}")
    # The calibration measures what a policy would be built from, under none: a pin or a stale
    # calibration in the environment does not apply to it.
    plan = model_plan(run, with_policy=False)
    check_out_path(t.out, "--out")
    # The ceiling only shapes the choices printed here; the file holds every point, and each run
    # applies its own ceiling.
    ceiling = resolve_ceiling(run.slices.ceiling)
    return plan, sorted(set(rows)), sorted(set(pins)), ceiling


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


def measure(unit: Unit, rows_list: list[int], pins: list[int], reps: int, device) -> list[Point]:
    """Every point once per rep, reps outermost, so a slow patch of machine lands on every point."""
    order = [(r, s) for r in rows_list for s in pins]
    for r, s in order:
        unit.run(r, s)
    times: dict[tuple[int, int], list[float]] = {p: [] for p in order}
    bar = row_progress(sum(_timed_rows(r) for r, _ in order) * reps, "calibrate")
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


def format_points(points: list[Point], policy: CalibratedPolicy) -> list[str]:
    pins = sorted({p.slices for p in points})
    by = {(p.rows, p.slices): p for p in points}
    lines = ["rows  " + "".join(f"{'slices=' + str(s):>14}" for s in pins) + f"   chosen (ceiling {policy.ceiling})"]
    for rows, chosen in policy.choices.items():
        cells = "".join(f"{by[(rows, s)].seconds * 1e3:>11.2f} ms" if (rows, s) in by else f"{'-':>14}" for s in pins)
        lines.append(f"{rows:<6}{cells}   {chosen}")
    return lines


def _work(run, device, inputs) -> int:
    t, dtype = run.task, run.source.dtype
    plan, rows_list, pins, ceiling = inputs
    world = tp().world
    sites = row_parallel_sites(plan.cfg, world)
    hidden = plan.cfg.hidden_size
    say(
        f"calibrating {plan.model_name} at TP={world} on {collective.name()} ({device.describe()}), {dtype}: "
        f"unit {' + '.join(f'{s.count} {s.name}' for s in sites)}, {len(rows_list)} row counts x {len(pins)} slice counts x {t.reps} reps"
    )
    unit = Unit(sites, hidden, max(rows_list), plan.dtype, device.torch_device, site_schemes(plan.cfg))
    say(unit.choose_kernels(rows_list))
    points = measure(unit, rows_list, pins, t.reps, device)
    sizes, fit = sweep_sizes(payload_sizes(rows_list, pins, hidden, plan.dtype.itemsize), plan.dtype, device, ALLREDUCE_FIT_ITERS, 2, world)
    if tp().rank == 0:
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        fit_json = fit.to_json() | {"sizes_bytes": [r.size_bytes for r in sizes], "times_us": [r.time_us for r in sizes]}
        cal = Calibration(device.backend, device.describe(), world, hidden, dtype, created, points, fit_json)
        policy = CalibratedPolicy(cal, ceiling)
        for line in format_points(points, policy):
            print(line)
        print(f"all-reduce over the slice payloads: {fit.line()}")
        unit_text = " + ".join(f"{s.count} x {s.name} [rows, {s.in_local}] @ [{s.in_local}, {hidden}]" for s in sites)
        # The all-reduce the points were timed on (shm or the backend's): a file made on one
        # prices slicing wrongly for the other.
        extra = {"collective": collective.name(), "model": plan.model_name, "layers": plan.cfg.num_layers, "unit": unit_text, "reps": t.reps, "threads_per_rank": torch.get_num_threads()}
        with open(t.out, "w") as f:
            json.dump(cal.to_json() | extra, f, indent=2)
        print(f"wrote {t.out}: {policy.describe()}", flush=True)
    return 0


def run(args) -> int:
    task = Task(args.rows, args.pin, args.reps, args.out)
    return execute(model_free_run_plan(args, task, source_plan(args), SlicePlan(ceiling=args.comm_overlap_slices)))


def execute(run: RunPlan) -> int:
    return run_without_model(run, _prepare, _work)

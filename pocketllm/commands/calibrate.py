"""`pocketllm calibrate`: time the real overlapped projection at rows x slices points on this
machine and write the calibration file the calibrated slice policy is built from.

The timed unit is every row-parallel site of one repeat of the model's layer pattern, in the
pass's proportions: for the 3:1 hybrid, 4 mlp.down + 3 lin.out + 1 full.out. All three all-reduce
the same [rows, hidden] payload, but their GEMMs differ (mlp.down's inner size is intermediate/world,
3x lin.out's on the 27B shape), and the GEMM is what hides the collective, so timing mlp.down alone
would overstate what slicing buys at the other two sites while the policy picks one count for all.
Weights and activations are random: a GEMM's time does not depend on the values. The unit is
pocketllm/distributed/calibration_unit.py, which the ranks import: the launcher checks the run
without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from pocketllm.commands.ranked import run_without_model
from pocketllm.commands.settings import DEFAULT_WORLD, model_free_run_plan, source_plan
from pocketllm.distributed.calibration import Calibration
from pocketllm.distributed.policy import CalibratedPolicy, resolve_ceiling
from pocketllm.errors import UsageError
from pocketllm.flags import parse_positive_list
from pocketllm.model_args import add_rank_args, add_source_args, check_out_path, model_plan, say
from pocketllm.out_file import write_json
from pocketllm.run_plan import RunPlan, SlicePlan

ALLREDUCE_FIT_ITERS = 10


def add_arguments(p) -> None:
    # One rank has no all-reduce to calibrate: --tp-world defaults to 2, as for `allreduce`. The
    # command times every --pin count under no policy and profiles nothing, so it takes only the
    # rule's ceiling of the overlap flags (it shapes the choices printed).
    add_rank_args(p, default_world=DEFAULT_WORLD)
    add_source_args(p)
    p.add_argument("--comm-overlap-slices", help="the slice rule's ceiling for the choices printed (env POCKETLLM_COMM_OVERLAP_SLICES, alias QWEN_COMM_OVERLAP_SLICES, default 4)")
    p.add_argument("--rows", default="256,512,1024,2048,4096,8192", help="row counts to calibrate (default 256,512,1024,2048,4096,8192)")
    p.add_argument("--pin", default="1,2,4,8", help="slice counts to time at each row count (default 1,2,4,8; 1, serial, is always timed, "
                   "and a count above a row count is not, since those rows run serially)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, interleaved over every point (default 3)")
    p.add_argument("--out", required=True, help="the calibration file to write (JSON)")


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
    check_out_path(t.out, "--out", run.source.ckpt)
    # The ceiling only shapes the choices printed here; the file holds every point, and each run
    # applies its own ceiling.
    ceiling = resolve_ceiling(run.slices.ceiling)
    # One slice (serial) is what every other count is chosen against: timed whether asked or not.
    return plan, sorted(set(rows)), sorted(set(pins) | {1}), ceiling


def format_points(points: list, policy: CalibratedPolicy) -> list[str]:
    pins = sorted({p.slices for p in points})
    by = {(p.rows, p.slices): p for p in points}
    lines = ["rows  " + "".join(f"{'slices=' + str(s):>14}" for s in pins) + f"   chosen (ceiling {policy.ceiling})"]
    for rows, chosen in policy.choices.items():
        cells = "".join(f"{by[(rows, s)].seconds * 1e3:>11.2f} ms" if (rows, s) in by else f"{'-':>14}" for s in pins)
        lines.append(f"{rows:<6}{cells}   {chosen}")
    return lines


def _work(run, device, inputs) -> int:
    # A rank's imports: the launcher imports this module to check, and never imports torch.
    import torch

    from pocketllm.commands.progress import row_progress
    from pocketllm.distributed import collective
    from pocketllm.distributed.allreduce_bench import sweep_sizes
    from pocketllm.distributed.calibration_unit import Unit, measure, payload_sizes, row_parallel_sites, site_schemes
    from pocketllm.distributed.state import tp

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
    points = measure(unit, rows_list, pins, t.reps, device, row_progress)
    sizes, fit = sweep_sizes(payload_sizes(rows_list, pins, hidden, plan.itemsize), plan.dtype, device, ALLREDUCE_FIT_ITERS, 2, world)
    if tp().rank == 0:
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        fit_json = fit.to_json() | {"sizes_bytes": [r.size_bytes for r in sizes], "times_us": [r.time_us for r in sizes]}
        cal = Calibration(device.backend, device.describe(), world, hidden, dtype, created, points, fit_json)
        policy = CalibratedPolicy(cal, ceiling)
        for line in format_points(points, policy):
            print(line)
        print(f"all-reduce over the slice payloads: {fit.line()}")
        if fit.note():
            print(fit.note())
        unit_text = " + ".join(f"{s.count} x {s.name} [rows, {s.in_local}] @ [{s.in_local}, {hidden}]" for s in sites)
        # The all-reduce the points were timed on (shm or the backend's): a file made on one
        # prices slicing wrongly for the other.
        extra = {"collective": collective.name(), "model": plan.model_name, "layers": plan.cfg.num_layers, "unit": unit_text, "reps": t.reps, "threads_per_rank": torch.get_num_threads()}
        write_json(t.out, "--out", cal.to_json() | extra)
        print(f"wrote {t.out}: {policy.describe()}", flush=True)
    return 0


def run(args) -> int:
    task = Task(args.rows, args.pin, args.reps, args.out)
    return execute(model_free_run_plan(args, task, source_plan(args), SlicePlan(ceiling=args.comm_overlap_slices)))


def execute(run: RunPlan) -> int:
    return run_without_model(run, _prepare, _work)

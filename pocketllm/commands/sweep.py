"""`pocketllm sweep`: the seed's section 3 and 4 tables from one command. Load the model once,
then time prefill and decode at every (rows, setting), where a setting is a pinned slice count or a
named policy, with repetitions interleaved rep-major so a slow patch of machine lands on every
setting. Prints the tables, optionally writes every run as JSON and a plot.

The launcher imports this module to check the run and never imports torch: what the ranks run
imports the engine's modules where it runs."""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass

from pocketllm.bench.plot import plot_sweep, require_matplotlib
from pocketllm.bench.sweep_report import Setting, format_report, pinned
from pocketllm.commands.ranked import run_with_model
from pocketllm.commands.settings import model_run_plan
from pocketllm.distributed.policy import ENV_CALIBRATION, ENV_PIN, OVERLAP_POLICIES, PinnedPolicy, collective_note, resolve_policy
from pocketllm.errors import UsageError
from pocketllm.flags import add_warmup_arg, check_warmup_tokens, parse_positive_list
from pocketllm.inputs import bench_ids, checked_bench_ids
from pocketllm.model_args import add_overlap_args, add_profiling_args, add_rank_args, add_source_args, check_out_path, checked_for_run, say
from pocketllm.out_file import write_json
from pocketllm.run_plan import RunPlan
from pocketllm.switches import env_value


def add_arguments(p) -> None:
    # The sweep times its own pins (--pin) and names its own policies (--policy), so it takes
    # neither --pin-slices nor --overlap-policy.
    add_rank_args(p)
    add_source_args(p)
    add_overlap_args(p, pin=False, policy=False)
    add_profiling_args(p)
    p.add_argument("--rows", default="512,1024,2048,4096", help="prompt lengths to time (default 512,1024,2048,4096)")
    p.add_argument("--pin", default="1,2,4,8", help="pinned slice counts to time (default 1,2,4,8)")
    p.add_argument("--policy", help="named policies to time: rule, calibrated (default rule, plus calibrated when a calibration is given)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every (rows, setting), interleaved (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="timed decode steps per run; their spread is the drift bound (default 8)")
    add_warmup_arg(p)
    p.add_argument("--json", help="write every rep of every setting and the summary here")
    p.add_argument("--plot", help="write a PNG of prefill TPS against rows here (needs matplotlib)")


def sweep_order(rows_list: list[int], settings: list[str], reps: int) -> list[tuple[int, int, str]]:
    """(rep, rows, setting) in the order they run: every (rows, setting) once per rep, reps
    outermost, then rows, then settings, all in the order given."""
    return [(rep, rows, s) for rep in range(1, reps + 1) for rows in rows_list for s in settings]


@dataclass(frozen=True)
class Task:
    """sweep's own settings in the run plan."""

    rows: str = "512,1024,2048,4096"
    pin: str = "1,2,4,8"
    policy: str | None = None
    reps: int = 3
    max_new_tokens: int = 8
    warmup_tokens: int | None = None
    json: str | None = None
    plot: str | None = None


def _policy_names(t: Task, calibration: str | None) -> list[str]:
    if t.policy is None:
        given = calibration or env_value(os.environ, ENV_CALIBRATION)
        return ["rule", "calibrated"] if given else ["rule"]
    names = [n.strip() for n in t.policy.split(",")]
    if not any(names):
        raise UsageError(f"--policy is empty; give a comma-separated list of {', '.join(OVERLAP_POLICIES)}")
    for n in names:
        if n not in OVERLAP_POLICIES:
            raise UsageError(f"--policy: {n!r} is not one of {', '.join(OVERLAP_POLICIES)}")
    if "calibrated" in names and not (calibration or env_value(os.environ, ENV_CALIBRATION)):
        raise UsageError(f"--policy calibrated needs --calibration FILE (or env {ENV_CALIBRATION})")
    return list(dict.fromkeys(names))


def build_settings(run, plan) -> list[tuple[Setting, object]]:
    """Each setting with the SlicePolicy that runs it: the pins, then the named policies."""
    t, slices = run.task, run.slices
    out = [(pinned(k), PinnedPolicy(k)) for k in parse_positive_list(t.pin, "--pin")]
    # A pin in the environment must not turn the named policies into pins as well.
    env = {k: v for k, v in os.environ.items() if k != ENV_PIN}
    for name in _policy_names(t, slices.calibration):
        choice = resolve_policy(None, slices.ceiling, env, overlap_policy=name, calibration=slices.calibration)
        out.append((Setting(name, None), checked_for_run(choice, run, plan.cfg.hidden_size).policy))
    return out


def _prepare(run, plan):
    t = run.task
    rows_list = parse_positive_list(t.rows, "--rows")
    if len(set(rows_list)) != len(rows_list):
        raise UsageError(f"--rows {t.rows}: a row count is repeated")
    if t.reps < 1:
        raise UsageError(f"--reps must be >= 1, got {t.reps}")
    if t.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 for a sweep (decode is the drift bound), got {t.max_new_tokens}")
    check_warmup_tokens(t.warmup_tokens)
    settings = build_settings(run, plan)
    if len({s.name for s, _ in settings}) != len(settings):
        raise UsageError(f"--pin {t.pin}: a slice count is repeated")
    checked_bench_ids(max(rows_list), plan.cfg, t.max_new_tokens, sized_by="--rows")
    check_out_path(t.json, "--json", run.source.ckpt)
    check_out_path(t.plot, "--plot", run.source.ckpt)
    if t.plot and Path(t.plot).suffix.lower() != ".png":
        # Found by matplotlib only after the whole sweep, from the name's suffix.
        raise UsageError(f"--plot {t.plot}: the plot is written as a PNG; give a name ending in .png")
    if t.plot:
        require_matplotlib()
    return rows_list, settings


def run_sweep(engine, rows_list, settings, t: Task, sync) -> list[dict]:
    from pocketllm.commands.progress import row_progress
    from pocketllm.distributed.overlap import is_serial
    from pocketllm.engine.timing import timed_prefill_decode, warm_up

    policies = {s.name: policy for s, policy in settings}
    ids = bench_ids(max(rows_list), engine.cfg.vocab_size)
    engine.reserve_slots(1, max(rows_list) + t.max_new_tokens)
    for s, policy in settings:
        engine.policy = policy
        warm_up(engine, ids, rows_list, sync, t.warmup_tokens)
    order = sweep_order(rows_list, [s.name for s, _ in settings], t.reps)
    bar = row_progress(sum(rows for _, rows, _ in order), "sweep")
    records = []
    for rep, rows, name in order:
        bar.set_description(f"rep {rep}/{t.reps} rows={rows} {name}")
        engine.policy = policies[name]
        with engine.tagged(timed=True):
            r = timed_prefill_decode(engine, ids[:rows], t.max_new_tokens, sync)
        records.append({"rep": rep, "rows": rows, "setting": name, "serial": is_serial(rows, r["slices"]), **r})
        bar.update(rows)
    bar.close()
    return records


def _work(run, plan, inputs, engine, device) -> int:
    from pocketllm.commands.on_rank import run_settings
    from pocketllm.distributed import collective
    from pocketllm.distributed.state import tp

    t = run.task
    rows_list, settings = inputs
    for _, policy in settings:
        # A calibrated setting's all-reduce, against the one the ranks set up (as any run's).
        note = collective_note(policy, collective.name(), run.slices.force_calibration)
        if note:
            say(f"note: {note}")
    records = run_sweep(engine, rows_list, settings, t, device.synchronize)
    if tp().rank != 0:
        return 0
    lines, report = format_report(records, rows_list, [s for s, _ in settings])
    settings_json = {
        **run_settings(run, plan, device),
        "rows": rows_list,
        "settings": {s.name: policy.describe() for s, policy in settings},
        "reps": t.reps,
        "max_new_tokens": t.max_new_tokens,
        "calibration": run.slices.calibration or env_value(os.environ, ENV_CALIBRATION),
    }
    if t.json:
        write_json(t.json, "--json", {"settings": settings_json, "runs": records, **report})
    if t.plot:
        title = f"{plan.model_name}, {plan.cfg.num_layers} layers, TP={tp().world} {settings_json['collective'] or ''}, {run.source.dtype}, {device.describe()}"
        plot_sweep(records, rows_list, [s for s, _ in settings], t.plot, title)
    print("\n".join(lines), flush=True)
    return 0


def run(args) -> int:
    task = Task(args.rows, args.pin, args.policy, args.reps, args.max_new_tokens, args.warmup_tokens, args.json, args.plot)
    return execute(model_run_plan(args, task))


def execute(run: RunPlan) -> int:
    return run_with_model(run, _prepare, _work)

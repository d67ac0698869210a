"""`pocketllm profile`: the seed's section 5 measurement as one command. Load once, warm up, then
one timed prefill per prompt length under the device-synced phase profile, on the serial path
unless a slice count is given (as the seed ran it); rank 0 prints the attribution table (5.2) and
the all-reduce priced from the same blocks (5.3). Each column is read from exactly one block, the
one whose id the timed prefill's pass reported, never by matching numbers.

The launcher imports this module to check the run and never imports torch: what the ranks run
imports the engine's modules where it runs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pocketllm.commands.ranked import run_with_model
from pocketllm.commands.settings import model_run_plan, phase_asked, profiling_plan, slice_plan
from pocketllm.distributed.policy import ENV_CALIBRATION, ENV_CEILING, ENV_PIN
from pocketllm.errors import UsageError
from pocketllm.flags import add_warmup_arg, check_warmup_tokens, parse_positive_list
from pocketllm.inputs import bench_ids, checked_bench_ids
from pocketllm.model_args import add_model_args, check_out_path
from pocketllm.out_file import write_json
from pocketllm.profiling.tables import (
    RANK_VIEW_SCOPES,
    attribution_table,
    collective_points,
    collective_table,
    two_point_fit,
)
from pocketllm.run_plan import RunPlan
from pocketllm.switches import env_value

DEFAULT_LENGTHS = "1105,2223,4433"
PICKS = ("median", "min")


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--prompt-tokens", default=DEFAULT_LENGTHS, help=f"comma-separated prompt lengths (default the seed's {DEFAULT_LENGTHS})")
    p.add_argument("--reps", type=int, default=1, help="timed prefills per length, run rep-major (default 1)")
    p.add_argument(
        "--pick", choices=PICKS, default="median", help="which rep's block each column reads: the median wall (default) or the least disturbed, min"
    )
    add_warmup_arg(p)
    p.add_argument("--json", help="also write the tables, the fit and every column's block to this file")


def parse_lengths(text: str) -> list[int]:
    # The fit reads the shortest and longest lengths as its two points.
    return sorted(set(parse_positive_list(str(text), "--prompt-tokens")))


@dataclass(frozen=True)
class Task:
    """profile's own settings in the run plan."""

    prompt_tokens: str = DEFAULT_LENGTHS
    reps: int = 1
    pick: str = "median"
    warmup_tokens: int | None = None
    json: str | None = None


def _prepare(run, plan):
    t = run.task
    lengths = parse_lengths(t.prompt_tokens)
    checked_bench_ids(lengths[-1], plan.cfg, 0)
    if t.reps < 1:
        raise UsageError(f"--reps must be >= 1, got {t.reps}")
    check_warmup_tokens(t.warmup_tokens)
    check_out_path(t.json, "--json", run.source.ckpt)
    return lengths


def _timed_prefill(engine, ids: list[int], sync) -> tuple[float, int]:
    """prefill_seconds of one timed prefill from a fresh sequence, and its pass's block id."""
    from pocketllm.engine.timing import timed_prefill

    with engine.tagged(timed=True):
        wall, timed = timed_prefill(engine, ids, sync)
        timed.close()
    return wall, engine.last_pass.index


def _report(run, plan, device, runs: list[dict]) -> None:
    from pocketllm.commands.on_rank import run_settings
    from pocketllm.distributed.state import tp

    t, split_skew = run.task, run.profiling.split_skew
    cfg = plan.cfg
    # One all-reduce per row-parallel site of each layer (mixer out, mlp.down) plus the embedding's.
    points = collective_points(runs, cfg.hidden_size, plan.itemsize, 2 * cfg.num_layers + 1)
    fit = two_point_fit(points)
    paths = sorted({r["block"]["path"] for r in runs})
    print(
        f"qwen_profile model={plan.model_name} layers={cfg.num_layers} tp={tp().world} dtype={run.source.dtype} "
        f"device={device.describe().replace(' ', '_')} policy={plan.policy.policy.describe().replace(' ', '_')} "
        f"path={','.join(paths)} split_skew={int(split_skew)} reps={t.reps} pick={t.pick} rank=0"
    )
    # One rank has no all-reduce to wait in.
    if tp().world > 1 and split_skew:
        print("note: tp_skew is the wait for the slowest rank (plus one barrier per call); tp_all_reduce is the collective alone")
    elif tp().world > 1:
        print("note: tp_all_reduce includes the wait for the slowest rank to arrive; --split-skew times that wait as tp_skew")
    if paths != ["serial"]:
        print("note: the phase profile waits each slice's all-reduce inside its scope: the overlapped path without its overlap")
    print("\nattribution (seed 5.2): device-synced phase profile, exclusive seconds (% of STACK), timed prefill, rank 0")
    print(attribution_table(runs))
    print("\nall-reduce priced from the same blocks (seed 5.3)")
    print(collective_table(points, fit), flush=True)
    if t.json:
        doc = {
            "settings": {
                **run_settings(run, plan, device),
                "policy": plan.policy.policy.describe(),
                "reps": t.reps,
                "pick": t.pick,
                "split_skew": split_skew,
                "load_average": list(os.getloadavg()),
            },
            "runs": runs,
            "collective": {"points": points, "fit": fit},
        }
        write_json(t.json, "--json", doc)


def _pick_rep(samples: list[dict], pick: str) -> int:
    """The rep whose block a column reads. On a shared machine a rep that another process
    preempted has some scope inflated at random; `min` reads the least disturbed one."""
    order = sorted(range(len(samples)), key=lambda i: samples[i]["prefill_seconds"])
    return order[0] if pick == "min" else order[(len(order) - 1) // 2]


def _gather_rank_views(runs: list[dict]) -> None:
    """Add every rank's STACK, tp_all_reduce and tp_skew seconds for the chosen pass to each run:
    a rank that waited for a slower one shows it as collective (or skew) time."""
    import torch

    from pocketllm.distributed.state import all_gather_cat, tp

    names = RANK_VIEW_SCOPES
    mine = torch.tensor(
        [[(r["block"]["scopes"].get(name) or {}).get("seconds", 0.0) for name in names] for r in runs], dtype=torch.float64
    )
    every = all_gather_cat(mine.reshape(1, -1)).reshape(tp().world, len(runs), len(names))
    for i, run in enumerate(runs):
        run["ranks"] = [dict(zip(("rank",) + names, [rank] + every[rank, i].tolist())) for rank in range(tp().world)]


def _work(run, plan, lengths, engine, device) -> int:
    import torch

    from pocketllm.distributed.state import broadcast_, tp
    from pocketllm.engine.timing import warm_up
    from pocketllm.profiling.profiler import profiler_of

    t = run.task
    profiler = profiler_of(engine)
    sync = device.synchronize
    vocab = plan.cfg.vocab_size
    warm_up(engine, bench_ids(lengths[-1], vocab), lengths, sync, t.warmup_tokens)
    samples: dict[int, list[dict]] = {n: [] for n in lengths}
    # Rep-major, so a slow patch of a shared machine lands on every length.
    for _rep in range(t.reps):
        for n in lengths:
            wall, index = _timed_prefill(engine, bench_ids(n, vocab), sync)
            samples[n].append({"prompt_tokens": n, "prefill_seconds": wall, "block": profiler.phase_block_for(index)})
    # Rank 0 picks each length's rep and every rank reports that same pass, so a column is one
    # pass seen from every rank.
    picks = torch.tensor([_pick_rep(samples[n], t.pick) for n in lengths], dtype=torch.long)
    broadcast_(picks)
    runs = []
    for n, pick in zip(lengths, picks.tolist()):
        chosen = dict(samples[n][pick])
        chosen["walls"] = [s["prefill_seconds"] for s in samples[n]]
        runs.append(chosen)
    _gather_rank_views(runs)
    if tp().rank == 0:
        _report(run, plan, device, runs)
    return 0


def _slices_given(args, env) -> bool:
    """Whether the run names a slice count or policy itself; if not, it is pinned to 1."""
    given = (args.pin_slices, args.comm_overlap_slices, args.overlap_policy, args.calibration)
    from_env = (env_value(env, ENV_PIN), env_value(env, ENV_CEILING), env_value(env, ENV_CALIBRATION))
    return any(v not in (None, "") for v in given + from_env)


def run(args) -> int:
    # The phase blocks go to stderr only when a phase profile was asked for explicitly: the tables
    # are this command's output. Host blocks, when asked for, print as in every other command.
    profiling = profiling_plan(args, phase=True, phase_text=phase_asked(args))
    slices = slice_plan(args, pin=None if _slices_given(args, os.environ) else "1")
    task = Task(args.prompt_tokens, args.reps, args.pick, args.warmup_tokens, args.json)
    return execute(model_run_plan(args, task, slices=slices, profiling=profiling))


def execute(run: RunPlan) -> int:
    return run_with_model(run, _prepare, _work)

"""Running a command on every rank: the launcher checks, then starts the ranks
(pocketllm/launch.py); a rank joins the process group, takes rank 0's checked inputs, does the
work, and any failure ends it with one line (pocketllm/rank.py). run_on_every_rank is that
sequence for any command; run_with_model adds the checked model and the loaded engine for a model
command, run_without_model the group of two or more that the model-free `allreduce` and
`calibrate` time. Each takes the run plan (pocketllm/run_plan.py), never the command line.

This module is the launcher's half and imports no torch: a launcher checks the inputs and starts
its ranks without it, so they start sooner; what a rank runs is pocketllm/commands/on_rank.py,
imported on the rank alone."""

from __future__ import annotations

from pocketllm.errors import UsageError
from pocketllm.launch import spawn_local_ranks
from pocketllm.model_args import model_plan
from pocketllm.place import rank_env
from pocketllm.run_plan import RunPlan
from pocketllm.startup import importing


def run_with_model(run: RunPlan, prepare, work, forward_signals: float = 0.0) -> int:
    """prepare(run, plan) checks the command's own inputs against the checked model plan and
    returns them; work(run, plan, inputs, engine, device) runs on every rank with the engine
    loaded. forward_signals (seconds): a launcher passes SIGINT/SIGTERM to rank 0 and lets the
    ranks end themselves for that long (serve, generate), instead of stopping them at once."""
    renv = place_of(run)

    def loaded_work(device, checked) -> int:
        from pocketllm.commands.on_rank import load_then_work

        return load_then_work(run, renv, device, checked, work)

    return run_on_every_rank(run, renv, lambda: _checked(run, prepare), loaded_work, forward_signals)


def place_of(run: RunPlan):
    """This process's place in the run (pocketllm.place.rank_env), None in a launcher that starts
    the ranks. The plan's world is already the run's (pocketllm/commands/settings.py checked it)."""
    w = run.world
    return rank_env(w.size, w.rank, w.rendezvous_file, default_world=w.size)


def run_on_every_rank(run: RunPlan, renv, check, on_rank, forward_signals: float = 0.0) -> int:
    """The sequence every command that runs on ranks shares. With no renv (this process starts the
    ranks): check(), then start the plan's world of ranks, each given the plan and check()'s
    result. On a rank: set up the plan's device; rank 0 shares the launcher's result, or with no
    launcher runs check() once, over the group every rank joins (so the result must pickle); then
    on_rank(device, checked)."""
    if renv is None:
        # The launcher checks everything before it starts a rank: a bad input starts nothing, and
        # the ranks run on what it checked.
        return spawn_local_ranks(run, forward_signals, check())

    # A rank: what it runs (torch, the engine) is imported here, never in a launcher.
    with importing():
        from pocketllm.commands.on_rank import run_as_rank

    return run_as_rank(run, renv, check, on_rank)


def _checked(run: RunPlan, prepare):
    plan = model_plan(run)
    return plan, prepare(run, plan)


def run_without_model(run: RunPlan, prepare, work) -> int:
    """prepare(run) checks the command's own inputs and returns them: in the launcher before any
    rank starts, and on rank 0 alone once the ranks run, which shares the result (so it must
    pickle) with the others; work(run, device, inputs) runs on every rank of a world of two or
    more, started here if need be. The model-free commands (allreduce, calibrate) run this way:
    neither needs weights, only the process group and the device."""
    # Every process checks the world it is part of, before it starts or joins a group.
    if run.world.size < 2:
        raise UsageError(f"--tp-world must be >= 2 to time an all-reduce, got {run.world.size}")
    renv = place_of(run)
    return run_on_every_rank(run, renv, lambda: prepare(run), lambda device, inputs: work(run, device, inputs))

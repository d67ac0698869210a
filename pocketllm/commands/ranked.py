"""Running a command on every rank: the launcher checks, then starts the ranks
(pocketllm/launch.py); a rank joins the process group, takes rank 0's checked inputs, does the
work, and any failure ends it with one line (pocketllm/rank.py). run_on_every_rank is that
sequence for any command; run_with_model adds the plan and the loaded engine for a model command,
run_without_model the group of two or more that the model-free `allreduce` and `calibrate` time."""

from __future__ import annotations

import os
import resource
import time

import torch

from pocketllm.device import allowed_cpus, device_index, resolve_kind, setup_device
from pocketllm.distributed import collective, waiting
from pocketllm.distributed.state import all_gather_cat, all_gather_objects, tp
from pocketllm.engine.runner import Engine
from pocketllm.errors import UsageError
from pocketllm.failures import PassTracker
from pocketllm.faults import FaultHook, fault_from_env
from pocketllm.launch import ENV_CPUS, ENV_PIN_MAP, spawn_local_ranks
from pocketllm.model_args import dist_timeout, plan_model, say
from pocketllm.profiling.profiler import attach_profiler, profile_options
from pocketllm.rank import checked_on_rank0, join_group, rank_env, run_rank, setup_collective
from pocketllm.switches import env_value


# The model-free commands (allreduce, calibrate) time collectives, so they need two ranks at
# least: the world a local run of theirs starts when --tp-world is not given.
DEFAULT_WORLD = 2


def run_with_model(args, argv: list[str], prepare, work, forward_signals: bool = False) -> int:
    """prepare(args, plan) checks the command's own inputs and returns them; work(args, plan,
    inputs, engine, device) runs on every rank with the engine loaded. forward_signals: a
    launcher passes SIGINT/SIGTERM to rank 0 and lets the ranks end themselves (serve), instead
    of stopping them."""
    renv = rank_of_this_process(args, default_world=1)
    profiling = profile_options(args)
    fault = fault_from_env(args.tp_world)
    return run_on_every_rank(
        args,
        argv,
        renv,
        lambda: _checked(args, prepare),
        lambda device, checked: _load_then_work(args, renv, device, checked, work, profiling, fault),
        forward_signals,
    )


def rank_of_this_process(args, default_world: int):
    """This process's place in the run (pocketllm.rank.rank_env; None in a launcher that starts
    the ranks), with args.tp_world set to the world the run has: torchrun's WORLD_SIZE, or
    default_world when --tp-world is not given, so that every later check sees it. Also checks
    the flags every process needs before it starts or joins a group; rank 0 cannot check them for
    a hand-started peer, which would otherwise wait on a group it can never join."""
    if args.dist_timeout is not None and args.dist_timeout <= 0:
        raise UsageError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    resolve_kind(args.device)
    collective.resolve_choice(getattr(args, "collective", None))
    renv = rank_env(args.tp_world, args.tp_rank, args.rendezvous_file, default_world=default_world)
    if renv is not None:
        args.tp_world = renv.world
    elif args.tp_world is None:
        args.tp_world = default_world
    _check_rank_placement(args, renv)
    return renv


def _check_rank_placement(args, renv) -> None:
    """--cpus and --device N where they cannot do what they say: --cpus pins only the ranks a
    launcher starts, and one device index cannot hold every rank a launcher starts on a GPU/NPU."""
    if renv is not None and renv.file_store is None:
        given = "--cpus" if getattr(args, "cpus", None) else ENV_CPUS if env_value(os.environ, ENV_CPUS).strip() else None
        if given:
            raise UsageError(f"{given} pins the ranks that --tp-world N starts here; pin a single-rank, hand-started or torchrun process with taskset -c")
    index = device_index(args.device)
    if renv is None and args.tp_world > 1 and index is not None and resolve_kind(args.device) != "cpu":
        raise UsageError(f"--device {index} names one device, and --tp-world {args.tp_world} starts a rank per device: give --device {resolve_kind(args.device)}")


def run_on_every_rank(args, argv: list[str], renv, check, on_rank, forward_signals: bool = False) -> int:
    """The sequence every command that runs on ranks shares. With no renv (this process starts the
    ranks): check(), then start args.tp_world ranks. On a rank: set up the device (args.device);
    rank 0 runs check() once and shares its result, which must pickle, over the group every rank
    joins (args.dist_timeout); then on_rank(device, checked)."""
    if renv is None:
        # The launcher checks everything before it starts a rank: a bad input starts nothing.
        check()
        return spawn_local_ranks(args.tp_world, argv, forward_signals, cpus=getattr(args, "cpus", None))

    def body() -> int:
        device = setup_device(args.device, renv.local_rank, renv.local_world)
        # Rank 0 checks the inputs once and shares them, so every rank runs on the same ones.
        checked = checked_on_rank0(renv, check, lambda: join_group(renv, device.backend, dist_timeout(args, device.backend)))
        setup_collective(renv, collective.resolve_choice(getattr(args, "collective", None)), device.backend)
        # The launcher's pinning map, which it gives rank 0 alone to print.
        pinned = env_value(os.environ, ENV_PIN_MAP)
        if pinned:
            say(pinned)
        return on_rank(device, checked)

    # run_rank leaves the process group after noting any failure, so the launcher hears the cause
    # before the peers notice this rank is gone.
    return run_rank(renv, body)


def _checked(args, prepare):
    plan = plan_model(args)
    return plan, prepare(args, plan)


def _load_then_work(args, renv, device, checked, work, profiling, fault) -> int:
    plan, inputs = checked
    if plan.policy.note:
        say(f"note: {plan.policy.note}")
    profiler = None
    try:
        t0 = time.perf_counter()
        faults = FaultHook(fault, renv.rank)
        faults.at("load")
        rss_before = current_rss_mib()
        engine = Engine(plan.cfg, plan.open_source(), plan.dtype, device.torch_device, plan.policy.policy)
        # What loading cost this rank at its peak, above what the process held before it.
        engine.load_peak_mib = peak_rss_mib() - rss_before
        engine.hooks.append(PassTracker())
        engine.say = say
        if faults.fault is not None:
            engine.hooks.append(faults)
        say(
            f"loaded {plan.model_name}: {plan.cfg.num_layers} layers, TP={tp().world}, {args.dtype} on {device.describe()}, "
            f"{engine.loaded_bytes / 2**20:.0f} MiB on rank 0 in {time.perf_counter() - t0:.1f} s"
        )
        if plan.cfg.weights is not None:
            on = "" if device.torch_device.type == "cpu" else f"; dequantized to {args.dtype} on {device.torch_device.type}, the quantized kernels being CPU-only"
            say(plan.cfg.weights.describe() + on)
        for line in engine.kernels.describe():
            say(line)
        say(engine.model.decode_ops.describe())
        kernel = engine.gdn_kernel
        say(f"gdn kernel: {kernel.describe() if kernel else 'none (no linear-attention layer)'}")
        profiler = attach_profiler(engine, profiling, tp().rank, device.synchronize, device.timing_event)
        return work(args, plan, inputs, engine, device)
    finally:
        if profiler is not None:
            profiler.close()


def run_settings(args, plan, device) -> dict:
    """What a result was measured on, for the JSON a command writes beside its figures."""
    return {
        "model": plan.model_name,
        "layers": plan.cfg.num_layers,
        "tp_world": tp().world,
        "dtype": args.dtype,
        "device": device.describe(),
        "backend": device.backend if tp().world > 1 else None,
        "threads_per_rank": torch.get_num_threads(),
        "polls_collectives": waiting.polling(),
        "collective": collective.name(),
    }


def current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return peak_rss_mib()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def per_rank(value: float) -> list[float]:
    """One number from every rank, gathered in rank order."""
    mine = torch.tensor([value], dtype=torch.float64)
    return [round(float(x), 1) for x in all_gather_cat(mine)]


def cpus_per_rank() -> list[list[int]]:
    """The cores each rank may run on (its CPU affinity), gathered in rank order."""
    return all_gather_objects(allowed_cpus())


def peak_rss_mib_per_rank() -> list[float]:
    """Each rank's peak resident memory so far, gathered in rank order."""
    return per_rank(peak_rss_mib())


def run_without_model(args, argv: list[str], prepare, work) -> int:
    """prepare(args) checks the command's own inputs and returns them: in the launcher before any
    rank starts, and on rank 0 alone once the ranks run, which shares the result (so it must
    pickle) with the others; work(args, device, inputs) runs on every rank of a --tp-world >= 2
    group, started here if need be. The model-free commands (allreduce, calibrate) run this way:
    neither needs weights, only the process group and the device."""
    renv = rank_of_this_process(args, default_world=DEFAULT_WORLD)
    # Every process checks the world it is part of, before it starts or joins a group.
    if args.tp_world < 2:
        raise UsageError(f"--tp-world must be >= 2 to time an all-reduce, got {args.tp_world}")
    return run_on_every_rank(args, argv, renv, lambda: prepare(args), lambda device, inputs: work(args, device, inputs))

"""The edge: a parsed command line (with the environment it names) turned into the run plan
(pocketllm/run_plan.py), each setting resolved and checked once, before any rank starts. Only the
commands and the CLI read an argparse namespace; everything they call takes the plan or its
fields."""

from __future__ import annotations

import os

from pocketllm.device_kind import device_index, resolve_kind
from pocketllm.distributed.collective_choice import check_choice, resolve_choice
from pocketllm.distributed.rendezvous import wait_seconds
from pocketllm.errors import UsageError
from pocketllm.fault_injection import fault_from_env
from pocketllm.launch import ENV_CPUS
from pocketllm.profiling.options import ProfileOptions, phase_requested, profile_options
from pocketllm.place import rank_env
from pocketllm.run_plan import DevicePlan, RunPlan, SlicePlan, SourcePlan, WorldPlan
from pocketllm.switches import env_value

# The model-free commands (allreduce, calibrate) time collectives, so they need two ranks at
# least: the world a local run of theirs starts when --tp-world is not given.
DEFAULT_WORLD = 2
MAX_TIMEOUT_S = 10**9  # ~31 years: beyond any run, and within what the process group's timedelta holds


def check_timeout(args) -> None:
    if args.dist_timeout is not None and not 0 < args.dist_timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"--dist-timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {args.dist_timeout}")


def device_plan(requested: str) -> DevicePlan:
    """--device resolved to a kind, once for the run: the ranks take the kind from the plan."""
    return DevicePlan(str(requested), resolve_kind(requested), device_index(requested))


def world_plan(args, device: DevicePlan, default_world: int) -> WorldPlan:
    """The world the run has (torchrun's WORLD_SIZE, else --tp-world, else `default_world`), and
    the flags every process needs checked before it starts or joins a group: rank 0 cannot check
    them for a hand-started peer, which would otherwise wait on a group it can never join."""
    choice, asked = resolve_choice(getattr(args, "collective", None))
    check_choice(choice, device.backend, asked)
    renv = rank_env(args.tp_world, args.tp_rank, args.rendezvous_file, default_world=default_world)
    size = renv.world if renv is not None else args.tp_world if args.tp_world is not None else default_world
    if size > 1:
        wait_seconds()  # its variable checked wherever it is set, not only where a rank by hand reads it
    cpus = getattr(args, "cpus", None)
    _check_rank_placement(cpus, device, size, renv)
    return WorldPlan(size, args.tp_rank, args.rendezvous_file, cpus, args.dist_timeout, choice, asked)


def _check_rank_placement(cpus: str | None, device: DevicePlan, size: int, renv) -> None:
    """--cpus and --device N where they cannot do what they say: --cpus pins only the ranks a
    launcher starts, and one device index cannot hold every rank a launcher starts on a GPU/NPU."""
    if renv is not None and renv.file_store is None:
        given = "--cpus" if cpus else ENV_CPUS if env_value(os.environ, ENV_CPUS).strip() else None
        if given:
            raise UsageError(f"{given} pins the ranks that --tp-world N starts here; pin a single-rank, hand-started or torchrun process with taskset -c")
    if renv is None and size > 1 and device.index is not None and device.kind != "cpu":
        raise UsageError(f"--device {device.requested} names one device, and --tp-world {size} starts a rank per device: give --device {device.kind}")
    if renv is not None and renv.id_path is None and renv.local_world > 1 and os.environ.get("LOCAL_WORLD_SIZE", "").strip() \
            and device.index is not None and device.kind != "cpu":
        # torchrun (which sets LOCAL_WORLD_SIZE) gives every rank on the host the same command
        # line: each would take that one device (NCCL refuses two ranks on one GPU). A rank
        # started by hand, by flags or by RANK and WORLD_SIZE alone, names its own.
        raise UsageError(f"--device {device.requested} names one device for each of this host's {renv.local_world} ranks: "
                         f"give --device {device.kind} (each rank takes its LOCAL_RANK's)")


def source_plan(args, layers: int | None = None, layers_flag: str = "--layers") -> SourcePlan:
    """`layers`, from `layers_flag`, stands in for --layers where a command takes it another way."""
    return SourcePlan(args.preset, args.ckpt, args.layers if layers is None else layers, args.dtype, getattr(args, "quantize", None), layers_flag)


def slice_plan(args, pin: str | None = None) -> SlicePlan:
    """The slice flags; a command without --pin-slices or --overlap-policy (sweep) plans as though
    they were not given, and `pin` stands in for --pin-slices where a command pins its own."""
    pin = getattr(args, "pin_slices", None) if pin is None else pin
    return SlicePlan(args.comm_overlap_slices, pin, getattr(args, "overlap_policy", None), args.calibration, bool(args.force_calibration))


def profiling_plan(args, phase: bool | None = None, phase_text: bool = True) -> ProfileOptions:
    return profile_options(
        args.phase_profile if phase is None else phase, args.host_profile, args.profile_out, args.trace_out, args.split_skew, phase_text
    )


def model_run_plan(args, task, default_world: int = 1, **replace) -> RunPlan:
    """The run plan of a model command, in the order its checks have always run: the device, the
    world, the profiles, the fault; `replace` gives a command's own source, slices or profiling."""
    check_timeout(args)
    device = device_plan(args.device)
    world = world_plan(args, device, default_world)
    source = replace.pop("source", None) or source_plan(args)
    slices = replace.pop("slices", None) or slice_plan(args)
    profiling = replace.pop("profiling", None) or profiling_plan(args)
    return RunPlan(args.command, device, world, source, slices, profiling, fault_from_env(world.size), task)


def model_free_run_plan(args, task, source: SourcePlan | None = None, slices: SlicePlan | None = None) -> RunPlan:
    """The run plan of a model-free command (allreduce, calibrate): its device and a world of two by
    default; calibrate names its model and slice ceiling too."""
    check_timeout(args)
    device = device_plan(args.device)
    world = world_plan(args, device, DEFAULT_WORLD)
    return RunPlan(args.command, device, world, source, slices or SlicePlan(), task=task)


def phase_asked(args) -> bool:
    """Whether --phase-profile or its environment variable asked for the phase profile."""
    return phase_requested(args.phase_profile, os.environ)


def tuple_or_none(value) -> tuple | None:
    """A repeatable flag's list (or one value) as the plan's tuple."""
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)

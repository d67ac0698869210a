"""What a rank runs around a command's work (pocketllm/commands/ranked.py starts it): set up the
device, join the group, take rank 0's checked inputs, set up the all-reduce; for a model command,
load the engine, say what it runs, then work. And the per-rank figures a command's result
gathers."""

from __future__ import annotations

import gc
import os
import resource
import time

import torch

from pocketllm.device import setup_device
from pocketllm.device_kind import allowed_cpus
from pocketllm.distributed import collective, one_host, waiting
from pocketllm.distributed.policy import collective_note
from pocketllm.distributed.state import all_gather_cat, all_gather_objects, tp
from pocketllm.engine.runner import Engine
from pocketllm.fault_injection import FaultHook
from pocketllm.launch import ENV_PIN_MAP
from pocketllm.model_args import say
from pocketllm.ops.gdn_choice import probe_note
from pocketllm.place import RankEnv
from pocketllm.profiling.profiler import attach_profiler
from pocketllm.rank import checked_on_rank0, join_group, run_rank, same_settings, setup_collective
from pocketllm.rank_failures import PassTracker
from pocketllm.run_plan import RunPlan
from pocketllm.switches import env_value


def run_as_rank(run: RunPlan, renv: RankEnv, check, on_rank) -> int:
    """This rank's part of run_on_every_rank: set up the plan's device; rank 0 shares the
    launcher's result, or with no launcher runs check() once, over the group every rank joins (so
    the result must pickle); then on_rank(device, checked)."""

    def body() -> int:
        device = setup_device(run.device.kind, run.device.index, renv.local_rank, renv.local_world)
        # Rank 0 checks the inputs once (or takes the launcher's check) and shares them, so every
        # rank runs on the same ones.
        checked = checked_on_rank0(renv, check, lambda: join_group(renv, device.backend, run.world.timeout(device.backend)))
        same_settings(renv, run.to_json())
        setup_collective(renv, run.world.collective, device.backend, run.world.collective_asked)
        # The launcher's pinning map, which it gives rank 0 alone to print.
        pinned = env_value(os.environ, ENV_PIN_MAP)
        if pinned:
            say(pinned)
        return on_rank(device, checked)

    # run_rank leaves the process group after noting any failure, so the launcher hears the cause
    # before the peers notice this rank is gone.
    return run_rank(renv, body)


def load_then_work(run: RunPlan, renv, device, checked, work) -> int:
    plan, inputs = checked
    dtype = run.source.dtype
    if plan.policy.note:
        say(f"note: {plan.policy.note}")
    # Which all-reduce runs is known only now (every rank agrees: rank 0 chose it).
    note = collective_note(plan.policy.policy, collective.name(), run.slices.force_calibration)
    if note:
        say(f"note: {note}")
    profiler = None
    try:
        t0 = time.perf_counter()
        faults = FaultHook(run.fault, renv.rank)
        faults.at("load")
        rss_before = current_rss_mib()
        note = probe_note(device.torch_device.type, plan.dtype)
        if note:
            say(note)
        engine = Engine(plan.cfg, plan.open_source(device.torch_device), plan.dtype, device.torch_device, plan.policy.policy)
        # What loading cost this rank at its peak, above what the process held before it.
        engine.load_peak_mib = peak_rss_mib() - rss_before
        engine.hooks.append(PassTracker())
        engine.say = say
        if faults.fault is not None:
            engine.hooks.append(faults)
        say(
            f"loaded {plan.model_name}: {plan.cfg.num_layers} layers, TP={tp().world}, {dtype} on {device.describe()}, "
            f"{engine.loaded_bytes / 2**20:.0f} MiB on rank 0 in {time.perf_counter() - t0:.1f} s"
        )
        if plan.reader is not None and plan.reader.note:
            say(plan.reader.note)
        if plan.cfg.weights is not None:
            on = "" if device.torch_device.type == "cpu" else f"; dequantized to {dtype} on {device.torch_device.type}, the quantized kernels being CPU-only"
            say(plan.cfg.weights.describe() + on)
        say(engine.layout.describe())
        for line in engine.kernels.describe():
            say(line)
        say(engine.model.decode_ops.describe())
        if not engine.pass_shape.cpu_forms:
            # A device's pass: what runs between its GEMMs (Triton kernels, or why not).
            say(engine.model.decode_ops.device.describe())
        if run.profiling.enabled and engine.step is not None:
            # A profile times the layers' scopes, so its decode rows take the layers' path.
            say(f"decode step: layer by layer (a profile times the layers; {engine.step_choice.name} otherwise)")
        else:
            say(engine.describe_step())
        kernel = engine.model.gdn_kernel
        say(f"gdn kernel: {kernel.describe() if kernel else 'none (no linear-attention layer)'}")
        note = one_host.finding(plan.cfg, plan.dtype, device.torch_device, cpus_per_rank)
        if note:
            say(note)
        profiler = attach_profiler(engine, run.profiling, tp().rank, device.synchronize, device.timing_event)
        # The loaded model lives as long as the work: the full collections a long run's
        # allocations set off now and then need not walk its objects each time. Unfrozen after
        # it, for a caller that goes on in this process (a test calling the CLI in-process).
        gc.freeze()
        return work(run, plan, inputs, engine, device)
    finally:
        gc.unfreeze()
        if profiler is not None:
            profiler.close()


def run_settings(run: RunPlan, plan, device) -> dict:
    """What a result was measured on, for the JSON a command writes beside its figures."""
    return {
        "model": plan.model_name,
        "layers": plan.cfg.num_layers,
        "tp_world": tp().world,
        "dtype": run.source.dtype,
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

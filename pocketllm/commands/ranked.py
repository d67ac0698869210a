"""Running a model command on every rank: plan and check in this process, start the ranks if this
process is the launcher, else join the process group, build the engine and do the work."""

from __future__ import annotations

import resource
import time

import torch

from pocketllm.device import setup_device
from pocketllm.distributed.state import all_gather_cat, tp
from pocketllm.engine.runner import Engine
from pocketllm.launch import init_distributed, rank_env, shutdown_distributed, spawn_local_ranks
from pocketllm.model_args import dist_timeout, plan_model, say


def run_ranked(args, argv: list[str], prepare, work) -> int:
    """prepare(args, plan) checks the command's own inputs and returns them; work(args, plan,
    inputs, engine, device) runs on every rank with the engine loaded."""
    renv = rank_env(args.tp_world, args.tp_rank, args.nccl_id_path)
    plan = plan_model(args)
    inputs = prepare(args, plan)
    if renv is None:
        return spawn_local_ranks(args.tp_world, argv)
    device = setup_device(args.device, renv.local_rank, renv.local_world)
    init_distributed(renv, device.backend, dist_timeout(args, device.backend))
    try:
        if plan.policy.note:
            say(f"note: {plan.policy.note}")
        t0 = time.perf_counter()
        engine = Engine(plan.cfg, plan.open_source(), plan.dtype, device.torch_device, plan.policy.policy)
        say(
            f"loaded {plan.model_name}: {plan.cfg.num_layers} layers, TP={tp().world}, {args.dtype} on {device.describe()}, "
            f"{engine.loaded_bytes / 2**20:.0f} MiB on rank 0 in {time.perf_counter() - t0:.1f} s"
        )
        return work(args, plan, inputs, engine, device)
    finally:
        shutdown_distributed()


def peak_rss_mib_per_rank() -> list[float]:
    """Each rank's peak resident memory so far, gathered in rank order."""
    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    return [round(float(x), 1) for x in all_gather_cat(mine)]

"""`pocketllm allreduce`: the nccl-tests style table of TP all-reduce cost per payload size on
this machine's backend, ending in the fit time = fixed + bytes / bandwidth.

It also holds the model-free way to run work on every rank, which `calibrate` shares: neither
command needs weights, only the process group and the device."""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from pocketllm.commands.ranked import run_checked
from pocketllm.device import DEVICE_CHOICES
from pocketllm.distributed.allreduce_bench import format_table, parse_size, size_ladder, sweep_sizes
from pocketllm.distributed.state import tp
from pocketllm.errors import UsageError
from pocketllm.launch import rank_env
from pocketllm.model_args import check_out_path, parse_dtype, say


# An all-reduce needs two ranks at least: the world a local run starts when --tp-world is not given.
DEFAULT_WORLD = 2


def add_rank_args(p) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp-world", type=int, help="ranks taking part (default 2, or torchrun's WORLD_SIZE); alone, starts them locally")
    g.add_argument("--tp-rank", type=int, help="this process's rank when starting one process per rank by hand")
    g.add_argument("--nccl-id-path", help="rendezvous file shared by hand-started ranks")
    g.add_argument("--device", default="auto", help=f"{', '.join(DEVICE_CHOICES)} (default auto)")
    g.add_argument("--dist-timeout", type=float, help="seconds a collective may wait (default 120 on gloo, 600 on NCCL/HCCL)")


def add_arguments(p) -> None:
    add_rank_args(p)
    p.add_argument("--min-bytes", default="1K", help="smallest payload (default 1K; K/M/G are powers of 1024)")
    p.add_argument("--max-bytes", default="64M", help="largest payload (default 64M)")
    p.add_argument("--factor", type=int, default=2, help="each size is this times the last (default 2)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup-iters", type=int, default=5, help="untimed calls per size first (default 5)")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 (default, the engine's) or float16")
    p.add_argument("--json", help="also write the table, the fit and the settings to this file")


def run_on_ranks(args, argv: list[str], prepare, work) -> int:
    """prepare(args) checks the command's own inputs and returns them: in the launcher before any
    rank starts, and on rank 0 alone once the ranks run, which shares the result (so it must
    pickle) with the others; work(args, device, inputs) runs on every rank of a --tp-world >= 2
    group, started here if need be."""
    renv = rank_env(args.tp_world, args.tp_rank, args.nccl_id_path, default_world=DEFAULT_WORLD)
    # Under torchrun the world comes from WORLD_SIZE when --tp-world is not given; prepare's checks
    # and the ones below must see the world the run has.
    if renv is not None:
        args.tp_world = renv.world
    elif args.tp_world is None:
        args.tp_world = DEFAULT_WORLD
    _check_group(args)
    return run_checked(args, argv, renv, lambda: prepare(args), lambda device, inputs: work(args, device, inputs))


def _check_group(args) -> None:
    """The group's own flags, checked by every process before it starts or joins a group, which
    they shape; rank 0 need not check them for the others."""
    if args.tp_world < 2:
        raise UsageError(f"--tp-world must be >= 2 to time an all-reduce, got {args.tp_world}")
    if args.dist_timeout is not None and args.dist_timeout <= 0:
        raise UsageError(f"--dist-timeout must be positive, got {args.dist_timeout}")


def _work(args, device, _inputs) -> int:
    dtype = parse_dtype(args.dtype)
    sizes = size_ladder(parse_size(args.min_bytes, "--min-bytes"), parse_size(args.max_bytes, "--max-bytes"), args.factor, dtype.itemsize)
    say(f"all-reduce on {device.backend}, {tp().world} ranks, {device.describe()}, {args.dtype}, {len(sizes)} sizes x {args.iters} calls")
    results, fit = sweep_sizes(sizes, dtype, device, args.iters, args.warmup_iters, tp().world)
    if tp().rank == 0:
        for line in format_table(results):
            print(line)
        print(fit.line(), flush=True)
        if args.json:
            out = {
                "backend": device.backend,
                "device": device.describe(),
                "world": tp().world,
                "dtype": args.dtype,
                "iters": args.iters,
                "threads_per_rank": torch.get_num_threads(),
                "sizes": [asdict(r) for r in results],
                "fit": fit.to_json(),
            }
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    return 0


def _check(args) -> None:
    """Every flag checked in the launcher, before any rank starts."""
    parse_dtype(args.dtype)
    size_ladder(parse_size(args.min_bytes, "--min-bytes"), parse_size(args.max_bytes, "--max-bytes"), args.factor, 1)
    if args.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {args.iters}")
    if args.warmup_iters < 0:
        raise UsageError(f"--warmup-iters must be >= 0, got {args.warmup_iters}")
    check_out_path(args.json, "--json")


def run(args, argv) -> int:
    return run_on_ranks(args, argv, _check, _work)

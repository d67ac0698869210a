"""`pocketllm allreduce`: the nccl-tests style table of TP all-reduce cost per payload size on
this machine's backend, ending in the fit time = fixed + bytes / bandwidth."""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from pocketllm.commands.ranked import DEFAULT_WORLD, run_without_model
from pocketllm.distributed import collective
from pocketllm.distributed.allreduce_bench import format_table, parse_size, size_ladder, sweep_sizes
from pocketllm.distributed.state import tp
from pocketllm.errors import UsageError
from pocketllm.model_args import add_rank_args, check_out_path, parse_dtype, say


def add_arguments(p) -> None:
    add_rank_args(p, default_world=DEFAULT_WORLD)
    p.add_argument("--min-bytes", default="1K", help="smallest payload (default 1K; K/M/G are powers of 1024)")
    p.add_argument("--max-bytes", default="64M", help="largest payload (default 64M)")
    p.add_argument("--factor", type=int, default=2, help="each size is this times the last (default 2)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup-iters", type=int, default=5, help="untimed calls per size first (default 5)")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 (default, the engine's) or float16")
    p.add_argument("--json", help="also write the table, the fit and the settings to this file")


def _work(args, device, _inputs) -> int:
    dtype = parse_dtype(args.dtype)
    sizes = size_ladder(parse_size(args.min_bytes, "--min-bytes"), parse_size(args.max_bytes, "--max-bytes"), args.factor, dtype.itemsize)
    say(f"all-reduce on {collective.name()}, {tp().world} ranks, {device.describe()}, {args.dtype}, {len(sizes)} sizes x {args.iters} calls")
    results, fit = sweep_sizes(sizes, dtype, device, args.iters, args.warmup_iters, tp().world)
    if tp().rank == 0:
        for line in format_table(results):
            print(line)
        print(fit.line(), flush=True)
        if args.json:
            out = {
                "backend": device.backend,
                "collective": collective.name(),
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
    return run_without_model(args, argv, _check, _work)

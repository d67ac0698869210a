"""`pocketllm allreduce`: the nccl-tests style table of TP all-reduce cost per payload size on
this machine's backend, ending in the fit time = fixed + bytes / bandwidth."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pocketllm.commands.ranked import run_without_model
from pocketllm.commands.settings import DEFAULT_WORLD, model_free_run_plan
from pocketllm.errors import UsageError
from pocketllm.flags import parse_size, size_ladder
from pocketllm.model_args import DTYPES, add_rank_args, check_dtype, check_out_path, parse_dtype, say
from pocketllm.out_file import write_json
from pocketllm.run_plan import RunPlan


def add_arguments(p) -> None:
    add_rank_args(p, default_world=DEFAULT_WORLD)
    p.add_argument("--min-bytes", default="1K", help="smallest payload (default 1K; K/M/G are powers of 1024)")
    p.add_argument("--max-bytes", default="64M", help="largest payload (default 64M)")
    p.add_argument("--factor", type=int, default=2, help="each size is this times the last (default 2)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup-iters", type=int, default=5, help="untimed calls per size first (default 5)")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 (default, the engine's) or float16")
    p.add_argument("--json", help="also write the table, the fit and the settings to this file")


@dataclass(frozen=True)
class Task:
    """allreduce's own settings in the run plan."""

    min_bytes: str = "1K"
    max_bytes: str = "64M"
    factor: int = 2
    iters: int = 20
    warmup_iters: int = 5
    dtype: str = "bfloat16"
    json: str | None = None


def _work(run, device, _inputs) -> int:
    # A rank's imports: the launcher imports this module to check, and never imports torch.
    import torch

    from pocketllm.distributed import collective
    from pocketllm.distributed.allreduce_bench import format_table, sweep_sizes
    from pocketllm.distributed.state import tp

    t = run.task
    dtype = parse_dtype(t.dtype)
    sizes = size_ladder(parse_size(t.min_bytes, "--min-bytes"), parse_size(t.max_bytes, "--max-bytes"), t.factor, dtype.itemsize)
    say(f"all-reduce on {collective.name()}, {tp().world} ranks, {device.describe()}, {t.dtype}, {len(sizes)} sizes x {t.iters} calls")
    results, fit = sweep_sizes(sizes, dtype, device, t.iters, t.warmup_iters, tp().world)
    if tp().rank == 0:
        for line in format_table(results):
            print(line)
        print(fit.line(), flush=True)
        if fit.note():
            print(fit.note(), flush=True)
        if t.json:
            out = {
                "backend": device.backend,
                "collective": collective.name(),
                "device": device.describe(),
                "world": tp().world,
                "dtype": t.dtype,
                "iters": t.iters,
                "threads_per_rank": torch.get_num_threads(),
                "sizes": [asdict(r) for r in results],
                "fit": fit.to_json(),
            }
            write_json(t.json, "--json", out)
    return 0


def _check(run) -> None:
    """Every flag checked in the launcher, before any rank starts."""
    t = run.task
    elem = DTYPES[check_dtype(t.dtype)]
    sizes = size_ladder(parse_size(t.min_bytes, "--min-bytes"), parse_size(t.max_bytes, "--max-bytes"), t.factor, elem)
    if len(sizes) < 2:
        raise UsageError(
            f"--min-bytes {t.min_bytes} to --max-bytes {t.max_bytes} is one payload size, and the latency/bandwidth fit needs "
            f"two or more: give a --max-bytes of at least --factor ({t.factor}) times --min-bytes"
        )
    if t.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {t.iters}")
    if t.warmup_iters < 0:
        raise UsageError(f"--warmup-iters must be >= 0, got {t.warmup_iters}")
    check_out_path(t.json, "--json")


def run(args) -> int:
    task = Task(args.min_bytes, args.max_bytes, args.factor, args.iters, args.warmup_iters, args.dtype, args.json)
    return execute(model_free_run_plan(args, task))


def execute(run: RunPlan) -> int:
    return run_without_model(run, _check, _work)

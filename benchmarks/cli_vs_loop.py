"""`pocketllm bench` (the CLI: the launcher's plan, the pass tracker and fault hooks, rank 0's
prints) against the benchmarks' own runner (common.PocketRunner: a bare engine in a plain
process) on the same checkpoint, prompt and steps, each in a fresh process, interleaved rep-major
with the order alternated; prints both decode tok/s and their ratio. Both go through the same
generation loop, so the ratio is what the CLI's path costs a decode step.

    python benchmarks/cli_vs_loop.py [--preset small | --ckpt DIR] [--prompt-tokens 64] [--steps 64] [--reps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from common import Parser, PocketRunner, alternate, checkpoint_dir, even_reps, run_bench_json, run_json_line, script, spread

from pocketllm.inputs import bench_ids


def inner(args) -> None:
    """The runner's side, in this fresh process: one untimed run, then the timed one."""
    runner = PocketRunner(args.ckpt, args.dtype)
    ids = bench_ids(args.prompt_tokens, runner.cfg.vocab_size)
    runner.decode(ids, 2)
    seconds, _ = runner.decode(ids, args.steps)
    print(json.dumps({"decode_tokens_per_s": args.steps / seconds, "decode_step": runner.engine.describe_step()}))


def loop_run(args, ckpt: str) -> dict:
    cmd = [sys.executable, __file__, "--inner", "--ckpt", ckpt, "--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps)]
    return run_json_line(cmd, "the runner")


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--preset", default="small")
    p.add_argument("--ckpt")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--reps", type=even_reps, default=6, help="even, so each side runs first equally often (default 6)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    ckpt = checkpoint_dir(args)
    bench_args = ["--ckpt", ckpt, "--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens", str(args.steps)]
    tps = {"pocketllm bench": [], "benchmarks' runner": []}
    steps = {}
    for rep in range(args.reps):
        for name in alternate(list(tps), rep):
            out = run_bench_json(bench_args) if name == "pocketllm bench" else loop_run(args, ckpt)
            tps[name].append(out["decode_tokens_per_s"])
            steps[name] = out.get("decode_step") or out["settings"]["decode_step"]
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    for name, xs in tps.items():
        print(f"{name:<20} decode tok/s {spread(xs, 2)}  ({steps[name]})")
    cli, runner = tps.values()
    ratios = [a / b for a, b in zip(cli, runner)]
    print(f"bench / runner, per rep: {spread(ratios, 3)}; of the medians {statistics.median(cli) / statistics.median(runner):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

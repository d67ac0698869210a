"""Where a decode step of several sequences goes: the step against its projections alone.

One process, TP=1, the engine `pocketllm bench` runs. For each batch size B, interleaved over reps
(the order reversed every other rep), it times:
- B sequences' decode steps through the generation loop bench, generate and serve run
  (engine.timing.TimedRun), as the engine runs them (a pass of decode rows is one compiled call
  where it can be: models/compiled_step.py), and the same steps layer by layer;
- the step cut down to its projections at B rows: each projection's bound kernels (the engine's
  choice for B rows) on x [B, in] over the model's own weights, in step order, nothing else
  (common.gemv_only_step_seconds), with the GFLOP/s that makes.
What a step costs beyond its projections is the rest: the token mixers, norms, activation,
sampling and the loop.

    python benchmarks/batch_anatomy.py [--ckpt DIR | --preset small] [--batches 1,8] [--steps 32]
        [--reps 4] [--dtype bfloat16] [--quantize SCHEME] [--threads 2]
"""

from __future__ import annotations

import statistics
import sys

import torch

from pocketllm.engine.timing import TimedRun
from pocketllm.errors import UsageError
from pocketllm.flags import parse_positive_list
from pocketllm.inputs import bench_ids
from pocketllm.model_args import parse_dtype
from common import Parser, PocketRunner, alternate, checkpoint_dir, gemv_only_step_seconds, projection_weights, script, spread


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", help="HF checkpoint directory (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--batches", default="1,8", help="comma-separated sequences per step")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps per timing")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", help="a --quantize scheme to quantize the weights to at load")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    try:
        args.batches = parse_positive_list(args.batches, "--batches")
    except UsageError as exc:
        p.error(str(exc))
    if args.steps < 1 or args.reps < 1:
        p.error("--steps and --reps must be at least 1")
    return args


def step_ms(engine, batch: int, prompt_tokens: int, steps: int, layered: bool) -> float:
    """ms a decode step of `batch` fresh sequences (each prompt rotated by one, as bench --batch
    rotates them), after their prefill; layer by layer where asked."""
    ids = bench_ids(prompt_tokens, engine.model.cfg.vocab_size)
    prompts = [ids[i % len(ids):] + ids[: i % len(ids)] for i in range(batch)]
    run = TimedRun(engine, prompts, steps, lambda: None)
    saved = engine.step
    try:
        if layered:
            engine.step = None
        run.prefill()
        return 1e3 * run.decode(steps) / steps
    finally:
        engine.step = saved
        run.close()


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runner = PocketRunner(checkpoint_dir(args), parse_dtype(args.dtype), args.quantize)
    engine, model = runner.engine, runner.engine.model
    engine.reserve_slots(max(args.batches), args.prompt_tokens + args.steps + 2)
    weights = projection_weights(model)
    macs = sum(w.shape[0] * w.shape[1] for w in weights)
    settings = [(b, what) for b in args.batches for what in ("step", "step, layer by layer", "projections alone")]
    ms = {s: [] for s in settings}
    for rep in range(args.reps):
        for b, what in alternate(settings, rep):
            if what == "projections alone":
                ms[(b, what)].append(1e3 * gemv_only_step_seconds(model, reps=1, rows=b))
            else:
                ms[(b, what)].append(step_ms(engine, b, args.prompt_tokens, args.steps, what != "step"))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    quantized = f" quantize={args.quantize}" if args.quantize else ""
    print(f"{engine.describe_step()}; threads={args.threads} dtype={args.dtype}{quantized} reps={args.reps} steps={args.steps}")
    print(f"{'per decode step':<34}{'ms, median (min..max)':>28}{'tok/s':>10}{'GFLOP/s':>10}")
    for (b, what), xs in ms.items():
        m = statistics.median(xs)
        flops = f"{2 * macs * b / m / 1e6:.0f}" if what == "projections alone" else ""
        print(f"{f'batch {b}, {what}':<34}{spread(xs, 2):>28}{1e3 * b / m:>10.1f}{flops:>10}")
    for b in args.batches:
        rest = statistics.median(ms[(b, "step")]) - statistics.median(ms[(b, "projections alone")])
        print(f"batch {b}: the step beyond its projections {rest:.2f} ms (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

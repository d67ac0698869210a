"""Several requests of one prompt submitted together (a request's n choices, or a harness's prompts
sharing a context) through the scheduler, in this process, with prefix caching on and off: with it
on, the later ones wait for the first to cache its prompt's chunk ends and read only the rest.
Prints the time to the last first token and to the end, medians over interleaved reps (the order
reversed on odd reps), and the on/off ratios. The scheduler is serve's, without the HTTP side.

    python benchmarks/shared_prompt.py [--preset small] [--dtype bfloat16] [--prompt-tokens 1024]
        [--n 4] [--new-tokens 16] [--reps 4]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from common import Parser, alternate, even_reps, machine, positive_int, script, spread

from pocketllm.errors import UsageError


def run(sched, prompt: list[int], n: int, new: int, sampling) -> tuple[float, float]:
    """Seconds from submitting n requests of `prompt` to the last one's first token, and to the end."""
    t0 = time.perf_counter()
    reqs = [sched.submit(prompt, new, sampling(j)) for j in range(n)]
    first = None
    while sched.has_work:
        sched.step()
        if first is None and all(r.output for r in reqs):
            first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-tokens", type=positive_int, default=1024)
    p.add_argument("--n", type=positive_int, default=4, help="requests of the prompt, submitted together (default 4)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens each request generates (default 16)")
    p.add_argument("--reps", type=even_reps, default=4, help="reps of each setting, even so each order runs equally often (default 4)")
    args = p.parse_args(argv)

    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.engine.sampling import SamplingParams
    from pocketllm.engine.scheduler import Scheduler
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    set_tp(0, 1)
    cfg = get_preset(args.preset)
    max_len = args.prompt_tokens + args.new_tokens
    if max_len > cfg.max_position_embeddings:
        raise UsageError(f"--prompt-tokens + --new-tokens is {max_len}, over the model's {cfg.max_position_embeddings}")
    dtype = getattr(torch, args.dtype)
    engine = Engine(cfg, RandomWeights(cfg, dtype=dtype), dtype, torch.device("cpu"), RulePolicy())
    prompt = [(7919 * i) % (cfg.vocab_size - 1) + 1 for i in range(args.prompt_tokens)]

    def sampling(j: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=j)  # n choices: each its own draw

    settings = {"caching on": 4 * args.n * engine.slots.sequence_bytes(), "caching off": 0}
    run(Scheduler(engine, args.n, max_len), prompt, args.n, args.new_tokens, sampling)  # warms every shape
    got = {name: [] for name in settings}
    for rep in range(args.reps):
        for name in alternate(list(settings), rep):
            got[name].append(run(Scheduler(engine, args.n, max_len, prefix_cache_bytes=settings[name]), prompt, args.n, args.new_tokens, sampling))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(machine())
    print(f"{args.preset} {args.dtype}, {args.n} requests of one {args.prompt_tokens}-token prompt submitted together, {args.new_tokens} new tokens each; "
          f"seconds, median (min..max) of {args.reps} reps")
    print(f"{'measure':<22}{'caching on':>24}{'caching off':>24}{'on/off':>8}")
    for k, label in enumerate(("last first token", "all done")):
        on, off = [g[k] for g in got["caching on"]], [g[k] for g in got["caching off"]]
        print(f"{label:<22}{spread(on, 2):>24}{spread(off, 2):>24}{statistics.median(on) / statistics.median(off):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

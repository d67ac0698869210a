"""A chat replayed through the scheduler, in this process, with prefix caching on and off: each
turn resends the whole history (the previous prompt and answer) plus a new user message; prints
the time to first token of every turn, medians over interleaved reps (the order reversed on odd
reps), and the on/off ratio. The scheduler is serve's, without the HTTP side.

    python benchmarks/chat_turns.py [--preset small] [--dtype bfloat16] [--system 1000]
        [--user 100] [--answer 32] [--turns 4] [--reps 4]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from common import Parser, alternate, even_reps, positive_int, script, spread

from pocketllm.errors import UsageError


def turn_ttfts(sched, system: list[int], users: list[list[int]], answer: int) -> list[float]:
    """Seconds from submit to first token of each turn; the history grows by each answer."""
    history, ttfts = list(system), []
    for user in users:
        prompt = history + user
        req = sched.submit(prompt, answer)
        t0 = time.perf_counter()
        first = None
        while sched.has_work:
            sched.step()
            if first is None and req.output:
                first = time.perf_counter() - t0
        ttfts.append(first)
        history = prompt + req.output
    return ttfts


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--system", type=positive_int, default=1000, help="tokens of the first prompt (default 1000)")
    p.add_argument("--user", type=positive_int, default=100, help="tokens each later turn adds (default 100)")
    p.add_argument("--answer", type=positive_int, default=32, help="tokens of each answer (default 32)")
    p.add_argument("--turns", type=positive_int, default=4)
    p.add_argument("--reps", type=even_reps, default=4, help="reps of each setting, even so each order runs equally often (default 4)")
    p.add_argument("--chunk", type=positive_int, help="the engine's prefill chunk (default: the engine's own)")
    args = p.parse_args(argv)

    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.engine.scheduler import Scheduler
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    set_tp(0, 1)
    cfg = get_preset(args.preset)
    max_len = args.system + args.turns * (args.user + args.answer)
    if max_len > cfg.max_position_embeddings:
        raise UsageError(f"--system + --turns x (--user + --answer) is {max_len} tokens, over the model's {cfg.max_position_embeddings}")
    dtype = getattr(torch, args.dtype)
    engine = Engine(cfg, RandomWeights(cfg, dtype=dtype), dtype, torch.device("cpu"), RulePolicy())
    if args.chunk:
        engine.prefill_chunk = args.chunk
    vocab = cfg.vocab_size

    def ids(n: int, seed: int) -> list[int]:
        return [(7919 * i + 104729 * seed) % (vocab - 1) + 1 for i in range(n)]

    system = ids(args.system, 0)
    users = [ids(args.user, k + 1) for k in range(args.turns)]
    settings = {"caching on": 64 * engine.slots.sequence_bytes(), "caching off": 0}
    # One untimed chat warms the kernels at every shape.
    turn_ttfts(Scheduler(engine, 1, max_len), system, users, args.answer)
    got = {name: [[] for _ in users] for name in settings}
    for rep in range(args.reps):
        for name in alternate(list(settings), rep):
            sched = Scheduler(engine, 1, max_len, prefix_cache_bytes=settings[name])
            for k, t in enumerate(turn_ttfts(sched, system, users, args.answer)):
                got[name][k].append(t)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(f"{args.preset} {args.dtype}, prefill chunk {engine.prefill_chunk}, first prompt {args.system} tokens, +{args.user} per turn, {args.answer}-token answers; "
          f"time to first token, ms, median (min..max) of {args.reps} reps")
    print(f"{'turn':<6}{'caching on':>26}{'caching off':>26}{'on/off':>8}")
    for k in range(args.turns):
        on, off = [1e3 * t for t in got["caching on"][k]], [1e3 * t for t in got["caching off"][k]]
        print(f"{k + 1:<6}{spread(on):>26}{spread(off):>26}{statistics.median(on) / statistics.median(off):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The chunked gated delta rule at several chunk sizes, interleaved, over several sequence
lengths: the measurement behind DEFAULT_CHUNK_SIZE.

    python benchmarks/chunk_size.py [--sizes 32,64] [--lengths 128,512,4096] [--threads 2]

Inputs are gdn-bench's (one TP=4 rank of the 27B shape by default: 4 key / 12 value heads, head
dim 128, fp32). Each length is timed max(6, 20000 // tokens) reps (made even), every size once
per rep (the order reversed every other rep); prints the ms per size as median (min..max) and each
size's median over the first size's.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from common import Parser, alternate, int_list, positive_int, script, spread
from pocketllm.bench.gdn_bench import add_head_arguments, check_heads, make_inputs
from pocketllm.ops.gated_delta.chunked import gated_delta_rule_chunked


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--sizes", type=int_list(1), default="32,64")
    p.add_argument("--lengths", type=int_list(1), default="128,512,4096")
    add_head_arguments(p)
    p.add_argument("--threads", type=positive_int, default=2)
    args = p.parse_args(argv)
    check_heads(args.key_heads, args.value_heads)
    if args.head_dim < 1:
        p.error(f"--head-dim must be >= 1, got {args.head_dim}")
    torch.set_num_threads(args.threads)
    sizes = args.sizes
    print(f"threads={args.threads} Hk={args.key_heads} Hv={args.value_heads} D={args.head_dim} fp32; ms, median (min..max)")
    print(f"{'tokens':>7} {'reps':>5}" + "".join(f"{f'chunk {c}':>26}" for c in sizes) + "".join(f"{f'{c}/{sizes[0]}':>9}" for c in sizes[1:]))
    for T in args.lengths:
        x = make_inputs(T, args.key_heads, args.value_heads, args.head_dim, torch.float32)
        reps = max(6, 20000 // T)
        reps += reps % 2  # even, so each size runs first equally often
        times = {c: [] for c in sizes}
        for c in sizes:
            gated_delta_rule_chunked(*x, chunk_size=c)
        for rep in range(reps):
            for c in alternate(sizes, rep):
                t0 = time.perf_counter()
                gated_delta_rule_chunked(*x, chunk_size=c)
                times[c].append(1e3 * (time.perf_counter() - t0))
        med = {c: statistics.median(times[c]) for c in sizes}
        print(f"{T:>7} {reps:>5}" + "".join(f"{spread(times[c], 2):>26}" for c in sizes) + "".join(f"{med[c] / med[sizes[0]]:>9.2f}" for c in sizes[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

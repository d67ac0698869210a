"""`pocketllm bench` at TP=1 and at every other world size with each all-reduce (shm, gloo), on
the same cores, interleaved rep-major in fresh processes (the order reversed on odd reps); prints
prefill and decode tokens/s per setting and each against TP=1.

    python benchmarks/tp_ab.py [--worlds 1,2,4] [--collectives shm,gloo] [--reps 4]
        [bench flags, e.g. --ckpt small_ckpt --max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import Parser, alternate, even_reps, int_list, machine, run_bench_json, script, spread
from pocketllm.distributed.collective_choice import CHOICES


def collective_list(text: str) -> list[str]:
    """--collectives: POCKETLLM_COLLECTIVE values, checked before the first bench (a bad one was
    found at the first TP>1 run, after TP=1's)."""
    names = text.split(",")
    bad = [n for n in names if n not in CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(CHOICES)}")
    return names


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()), epilog="Any other flag goes to `pocketllm bench`.")
    p.add_argument("--worlds", type=int_list(1), default="1,2,4")
    p.add_argument("--collectives", type=collective_list, default="shm,gloo", help="POCKETLLM_COLLECTIVE values to run each world > 1 with")
    p.add_argument("--reps", type=even_reps, default=4, help="reps per setting, even so each order runs equally often (default 4)")
    args, bench_args = p.parse_known_args(argv)
    worlds = args.worlds
    settings = [(w, c) for w in worlds for c in (["-"] if w == 1 else args.collectives)]
    tps = {(s, kind): [] for s in settings for kind in ("prefill", "decode")}
    used = {}
    for rep in range(args.reps):
        for world, coll in alternate(settings, rep):
            env = {} if world == 1 else {"POCKETLLM_COLLECTIVE": coll}
            out = run_bench_json(["--tp-world", str(world), *bench_args], env=env)
            tps[((world, coll), "prefill")].append(out["prefill_tokens_per_s"])
            tps[((world, coll), "decode")].append(out["decode_tokens_per_s"])
            used[(world, coll)] = out["settings"].get("collective")
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(machine())
    print(f"pocketllm bench {' '.join(bench_args)}; reps={args.reps}; tok/s median (min..max); ratio of medians against the first setting")
    print(f"{'TP':<4}{'all-reduce':<12}{'prefill':>24}{'ratio':>7}{'decode':>24}{'ratio':>7}")
    base = settings[0]
    for s in settings:
        pre, dec = tps[(s, "prefill")], tps[(s, "decode")]
        r_pre = statistics.median(pre) / statistics.median(tps[(base, "prefill")])
        r_dec = statistics.median(dec) / statistics.median(tps[(base, "decode")])
        print(f"{s[0]:<4}{used[s] or '-':<12}{spread(pre):>24}{r_pre:>7.2f}{spread(dec, 2):>24}{r_dec:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

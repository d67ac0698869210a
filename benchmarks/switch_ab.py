"""`pocketllm bench` with an on/off environment switch on against the same run with it off,
interleaved rep-major in fresh processes (on first in even reps, off first in odd ones); prints
prefill and decode tokens/s per world size and the on/off ratios. The switches it is for:
POCKETLLM_PIN_CPUS (the launcher pins each rank to its share of the cores, the default) and
POCKETLLM_POLL_COLLECTIVES (gloo ranks poll for a collective instead of blocking in it).

    python benchmarks/switch_ab.py [--switch POCKETLLM_PIN_CPUS] [--worlds 2,4] [--reps 4]
        [bench flags, e.g. --preset small]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import alternate, run_bench_json, spread


def bench(world: int, switch: str, on: bool, bench_args: list[str]) -> dict:
    return run_bench_json(["--tp-world", str(world), *bench_args], env={switch: "1" if on else "0"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Any other flag goes to `pocketllm bench` (e.g. --ckpt DIR --max-new-tokens 64).")
    p.add_argument("--switch", default="POCKETLLM_PIN_CPUS", help="the environment switch to compare on and off")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--reps", type=int, default=4, help="reps per setting, even so on and off run first equally often (default 4)")
    args, bench_args = p.parse_known_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    tps = {(w, on, kind): [] for w in worlds for on in (True, False) for kind in ("prefill", "decode")}
    cpus = {}
    for rep in range(args.reps):
        for w in worlds:
            for on in alternate([True, False], rep):
                out = bench(w, args.switch, on, bench_args)
                tps[(w, on, "prefill")].append(out["prefill_tokens_per_s"])
                tps[(w, on, "decode")].append(out["decode_tokens_per_s"])
                cpus[(w, on)] = out["settings"]["cpus_per_rank"]
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(f"pocketllm bench {' '.join(bench_args)}; {args.switch} on and off; reps={args.reps}; tok/s median (min..max)")
    print(f"{'TP':<4}{'measure':<10}{'on':>24}{'off':>24}{'ratio':>8}")
    for w in worlds:
        for kind in ("prefill", "decode"):
            a, b = tps[(w, True, kind)], tps[(w, False, kind)]
            print(f"{w:<4}{kind:<10}{spread(a):>24}{spread(b):>24}{statistics.median(a) / statistics.median(b):>8.2f}")
        print(f"    cores per rank: on {cpus[(w, True)]}, off {cpus[(w, False)]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`pocketllm bench` with an on/off environment switch on against the same run with it off,
interleaved rep-major in fresh processes (on first in even reps, off first in odd ones); prints
prefill and decode tokens/s per world size and the on/off ratios. The switches it is for:
POCKETLLM_PIN_CPUS (the launcher pins each rank to its share of the cores, the default),
POCKETLLM_POLL_COLLECTIVES (gloo ranks poll for a collective instead of blocking in it) and, with
--values panels,rows, POCKETLLM_BF16_LAYOUT (the bf16 weights in panels or as loaded).

    python benchmarks/switch_ab.py [--switch POCKETLLM_PIN_CPUS] [--values 1,0] [--worlds 2,4]
        [--reps 4] [bench flags, e.g. --preset small]
"""

from __future__ import annotations

import statistics
import sys

from common import Parser, alternate, even_reps, int_list, machine, run_bench_json, script, spread, switch_name


def bench(world: int, switch: str, value: str, bench_args: list[str]) -> dict:
    return run_bench_json(["--tp-world", str(world), *bench_args], env={switch: value})


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()), epilog="Any other flag goes to `pocketllm bench` (e.g. --ckpt DIR --max-new-tokens 64).")
    p.add_argument("--switch", type=switch_name, default="POCKETLLM_PIN_CPUS", help="the environment switch to compare on and off")
    p.add_argument("--values", default="1,0", help="the switch's two values, on then off (default 1,0)")
    p.add_argument("--worlds", type=int_list(1), default="2,4")
    p.add_argument("--reps", type=even_reps, default=4, help="reps per setting, even so on and off run first equally often (default 4)")
    args, bench_args = p.parse_known_args(argv)
    worlds = args.worlds
    if len(args.values.split(",")) != 2:
        p.error(f"--values takes two values, on then off, not {args.values!r}")
    values = dict(zip((True, False), args.values.split(",")))
    tps = {(w, on, kind): [] for w in worlds for on in (True, False) for kind in ("prefill", "decode")}
    cpus = {}
    for rep in range(args.reps):
        for w in worlds:
            for on in alternate([True, False], rep):
                out = bench(w, args.switch, values[on], bench_args)
                tps[(w, on, "prefill")].append(out["prefill_tokens_per_s"])
                tps[(w, on, "decode")].append(out["decode_tokens_per_s"])
                cpus[(w, on)] = out["settings"]["cpus_per_rank"]
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(machine())
    print(f"pocketllm bench {' '.join(bench_args)}; {args.switch}={values[True]} and {values[False]}; reps={args.reps}; tok/s median (min..max)")
    print(f"{'TP':<4}{'measure':<10}{values[True]:>24}{values[False]:>24}{'ratio':>8}")
    for w in worlds:
        for kind in ("prefill", "decode"):
            a, b = tps[(w, True, kind)], tps[(w, False, kind)]
            print(f"{w:<4}{kind:<10}{spread(a):>24}{spread(b):>24}{statistics.median(a) / statistics.median(b):>8.2f}")
        print(f"    cores per rank: {values[True]} {cpus[(w, True)]}, {values[False]} {cpus[(w, False)]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`pocketllm bench --batch B` at every B, interleaved rep-major in fresh processes (the order
reversed on odd reps); prints aggregate prefill and decode tokens/s per B and each against the
first B. --baseline DIR adds `bench` (no --batch) run from another checkout, e.g. the commit before
batching, to show what batch 1 costs against it; repeat it for several checkouts.

    python benchmarks/batch_ab.py [--batches 1,8] [--reps 4] [--baseline DIR ...]
        [bench flags, e.g. --dtype bfloat16 --max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from common import alternate, run_bench_json, spread


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Any other flag goes to `pocketllm bench`.")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=4, help="reps per setting, even so each order runs equally often (default 4)")
    p.add_argument("--baseline", action="append", default=[], help="a checkout whose `pocketllm bench` runs as one more setting (repeatable)")
    args, bench_args = p.parse_known_args(argv)
    settings = [(int(b), None) for b in args.batches.split(",")]
    settings += [(1, tree) for tree in args.baseline]
    tps = {(s, kind): [] for s in settings for kind in ("prefill", "decode", "per_seq")}
    for rep in range(args.reps):
        for batch, tree in alternate(settings, rep):
            flags = bench_args if tree else ["--batch", str(batch), *bench_args]
            out = run_bench_json(flags, cwd=tree)
            tps[((batch, tree), "prefill")].append(out["prefill_tokens_per_s"])
            tps[((batch, tree), "decode")].append(out["decode_tokens_per_s"])
            tps[((batch, tree), "per_seq")].append(out.get("decode_tokens_per_s_per_sequence", out["decode_tokens_per_s"]))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(f"pocketllm bench {' '.join(bench_args)}; reps={args.reps}; aggregate tok/s median (min..max); ratio of medians against the first setting")
    print(f"{'setting':<22}{'prefill':>24}{'ratio':>7}{'decode':>24}{'ratio':>7}{'decode/seq':>22}")
    base = settings[0]
    for s in settings:
        pre, dec, per = tps[(s, "prefill")], tps[(s, "decode")], tps[(s, "per_seq")]
        r_pre = statistics.median(pre) / statistics.median(tps[(base, "prefill")])
        r_dec = statistics.median(dec) / statistics.median(tps[(base, "decode")])
        name = f"batch {s[0]}" if s[1] is None else f"bench @ {os.path.basename(os.path.normpath(s[1]))}"
        print(f"{name:<22}{spread(pre):>24}{r_pre:>7.2f}{spread(dec, 2):>24}{r_dec:>7.2f}{spread(per, 2):>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`pocketllm bench --batch B` at every B, interleaved rep-major in fresh processes (the order
reversed on odd reps); prints aggregate prefill and decode tokens/s per setting and each against
the first. --baseline DIR adds `bench` run from another checkout at every B (batch 1 without
--batch, so a checkout from before batching runs it), e.g. main, to show what this tree costs
against it; repeat it for several checkouts. --env NAME=VALUE adds this tree at every B with that
variable set, e.g. POCKETLLM_BATCH_INVARIANT=0.

    python benchmarks/batch_ab.py [--batches 1,8] [--reps 4] [--baseline DIR ...] [--env NAME=VALUE ...]
        [bench flags, e.g. --dtype bfloat16 --max-new-tokens 64]
"""

from __future__ import annotations

import os
import statistics
import sys

from common import Parser, alternate, checkout, env_setting, even_reps, int_list, machine, run_bench_json, script, spread


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()), epilog="Any other flag goes to `pocketllm bench`.")
    p.add_argument("--batches", type=int_list(1), default="1,8")
    p.add_argument("--reps", type=even_reps, default=4, help="reps per setting, even so each order runs equally often (default 4)")
    p.add_argument("--baseline", type=checkout, action="append", default=[], help="a checkout whose `pocketllm bench` runs at every B too (repeatable)")
    p.add_argument("--env", type=env_setting, action="append", default=[], help="NAME=VALUE: this tree at every B with it set, as more settings (repeatable)")
    args, bench_args = p.parse_known_args(argv)
    batches = args.batches
    envs = [None, *args.env]
    settings = [(b, None, env) for env in envs for b in batches]
    settings += [(b, tree, None) for tree in args.baseline for b in batches]
    tps = {(s, kind): [] for s in settings for kind in ("prefill", "decode", "per_seq")}
    for rep in range(args.reps):
        for setting in alternate(settings, rep):
            batch, tree, env = setting
            flags = bench_args if batch == 1 else ["--batch", str(batch), *bench_args]
            out = run_bench_json(flags, env=dict([env]) if env else None, cwd=tree)
            tps[(setting, "prefill")].append(out["prefill_tokens_per_s"])
            tps[(setting, "decode")].append(out["decode_tokens_per_s"])
            tps[(setting, "per_seq")].append(out.get("decode_tokens_per_s_per_sequence", out["decode_tokens_per_s"]))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(machine())
    print(f"pocketllm bench {' '.join(bench_args)}; reps={args.reps}; aggregate tok/s median (min..max); ratio of medians against the first setting")
    print(f"{'setting':<40}{'prefill':>24}{'ratio':>7}{'decode':>24}{'ratio':>7}{'decode/seq':>22}")
    base = settings[0]
    for s in settings:
        pre, dec, per = tps[(s, "prefill")], tps[(s, "decode")], tps[(s, "per_seq")]
        r_pre = statistics.median(pre) / statistics.median(tps[(base, "prefill")])
        r_dec = statistics.median(dec) / statistics.median(tps[(base, "decode")])
        name = f"batch {s[0]}" + (f" @ {os.path.basename(os.path.normpath(s[1]))}" if s[1] else "") + (f" {s[2][0]}={s[2][1]}" if s[2] else "")
        print(f"{name:<40}{spread(pre):>24}{r_pre:>7.2f}{spread(dec, 2):>24}{r_dec:>7.2f}{spread(per, 2):>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

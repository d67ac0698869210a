"""Whether a kernel cache written on a busy machine spoils later quiet runs: `pocketllm bench` loads
once with one busy loop per core spinning beside it (cache A), once on the quiet machine (cache
B); then quiet runs decode with cache A and with cache B, interleaved rep-major in fresh processes
(the order reversed on odd reps). Prints what each load chose, decode tok/s of each cache and the
ratio A/B with its spread. --baseline DIR runs the same from another checkout as well (e.g. the
commit before the kernel registry, whose busy load wrote what it measured).

    python benchmarks/busy_cache.py [--ckpt DIR | --preset small] [--reps 4] [--baseline DIR]
        [bench flags, e.g. --dtype bfloat16 --max-new-tokens 64 --prompt-tokens 64]
"""

from __future__ import annotations

import statistics
import sys

from common import Parser, absolute_path, alternate, checkout, checkpoint_dir, even_reps, run_bench_json, script, spread, temp_dir

from pocketllm.bench.busy import BusyLoops


def kernel_lines(out: dict) -> list[str]:
    """What a bench run's load chose, as its --json records it (this tree's or an older one's)."""
    s = out["settings"]
    if "kernels" in s:
        return [f"{c['kind']} ({c['how']}{'; ' + c['note'] if c['note'] else ''}): " + ", ".join(f"{k} {v}" for k, v in c["by_key"].items()) for c in s["kernels"]]
    return [f"one-row ({s['gemv']['how']}): " + ", ".join(f"{k} {v}" for k, v in s["gemv"]["by_shape"].items())]


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()), epilog="Any other flag goes to `pocketllm bench`.")
    p.add_argument("--ckpt", type=absolute_path, help="HF checkpoint directory (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=even_reps, default=4, help="quiet runs per cache, even so each order runs equally often (default 4)")
    p.add_argument("--baseline", type=checkout, help="a checkout to run the same comparison from")
    args, bench_args = p.parse_known_args(argv)
    flags = ["--ckpt", checkpoint_dir(args), "--dtype", args.dtype, *bench_args]
    trees = [None] + ([args.baseline] if args.baseline else [])
    # The caches' measured choices and compiled kernels are this run's alone: gone when it ends.
    root = temp_dir("pocketllm-busy-cache-")
    caches = {(t, c): f"{root}/{i}-{c}" for i, t in enumerate(trees) for c in ("busy", "quiet")}
    for tree in trees:
        name = "this tree" if tree is None else f"baseline {tree}"
        with BusyLoops():
            out = run_bench_json(flags, env={"POCKETLLM_CACHE_DIR": caches[(tree, "busy")]}, cwd=tree)
        print(f"{name}, load beside busy loops: " + "; ".join(kernel_lines(out)), flush=True)
        out = run_bench_json(flags, env={"POCKETLLM_CACHE_DIR": caches[(tree, "quiet")]}, cwd=tree)
        print(f"{name}, quiet load: " + "; ".join(kernel_lines(out)), flush=True)
    tps = {key: [] for key in caches}
    first = {}
    for rep in range(args.reps):
        for key in alternate(list(caches), rep):
            out = run_bench_json(flags, env={"POCKETLLM_CACHE_DIR": caches[key]}, cwd=key[0])
            tps[key].append(out["decode_tokens_per_s"])
            first.setdefault(key, kernel_lines(out))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(f"pocketllm bench {' '.join(flags)}; reps={args.reps}; decode tok/s median (min..max)")
    for tree in trees:
        name = "this tree" if tree is None else f"baseline {tree}"
        busy, quiet = tps[(tree, "busy")], tps[(tree, "quiet")]
        ratios = [b / q for b, q in zip(busy, quiet)]
        print(f"{name}: first quiet run with the busy load's cache: " + "; ".join(first[(tree, "busy")]))
        print(f"{name}: cache written beside busy loops {spread(busy)}, cache written quietly {spread(quiet)}, "
              f"ratio {statistics.median(busy) / statistics.median(quiet):.3f} (per rep {min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

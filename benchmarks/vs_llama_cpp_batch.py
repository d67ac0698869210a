"""Batched decode against llama.cpp on the same weights: B sequences prefilled together, then
decoded together one token each a step, aggregate tokens/s side by side at each B, and how each
engine's batch-B step scales against its own batch 1.

pocketllm runs `pocketllm bench --batch B --quantize SCHEME` (what the CLI runs, a fresh process
each time: B prompts packed in one prefill, then one row per sequence a decode step); llama.cpp
runs `llama-batched-bench -npl B` on the paired GGUF (B prompts of the same length decoded
together: its `S_PP` and `S_TG`), both on every core this process may use. Each pair is
(pocketllm scheme, GGUF), as in vs_llama_cpp_quant.py: none=small-bf16.gguf, int8=small-Q8_0.gguf,
int4=small-Q4_0.gguf. Reps are interleaved, the order of every setting reversed every other rep.

    python benchmarks/vs_llama_cpp_batch.py --ckpt DIR --llama-batched-bench PATH
        --pair none=bf16.gguf [--pair int8=Q8_0.gguf ...] [--batches 1,8]
        [--prompt-tokens 128] [--decode-tokens 32] [--reps 4] [--env NAME=VALUE ...]

The batched bench is built beside llama-bench:
`cmake --build BUILD --target llama-batched-bench` in the directory setup.sh printed.
--env sets a variable for both engines' processes (e.g. the four that hold a CPU to AVX2, where
the llama.cpp binary is an AVX2 build too).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys

from common import Parser, absolute_path, alternate, env_setting, even_reps, executable, int_list, parse_pairs, positive_int, run_bench_json, script, spread
from pocketllm import compiled


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", required=True, type=absolute_path, help="float checkpoint pocketllm quantizes at load (the GGUFs' source)")
    p.add_argument("--llama-batched-bench", required=True, type=executable, help="llama.cpp's llama-batched-bench binary")
    p.add_argument("--pair", action="append", required=True, help="SCHEME=GGUF: a pocketllm --quantize scheme (none: as stored) and the llama.cpp file set against it")
    p.add_argument("--batches", type=int_list(1), default="1,8", help="sequences decoded together, comma-separated (default 1,8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="each sequence's prompt (default 128)")
    p.add_argument("--decode-tokens", type=positive_int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--reps", type=even_reps, default=4, help="even, so each order runs equally often (default 4)")
    p.add_argument("--env", type=env_setting, action="append", default=[], help="NAME=VALUE set for both engines' processes (repeatable)")
    args = p.parse_args(argv)
    args.pairs = parse_pairs(p, args.pair)
    args.env = dict(args.env)
    return args


def pocket(args, scheme: str, batch: int) -> dict:
    flags = ["--ckpt", args.ckpt, "--quantize", scheme, "--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens", str(args.decode_tokens)]
    out = run_bench_json(flags if batch == 1 else [*flags, "--batch", str(batch)], env=args.env)
    return {"prefill": out["prefill_tokens_per_s"], "decode": out["decode_tokens_per_s"], "decode_step": out.get("decode_step", "")}


def llama(args, gguf: str, batch: int, threads: int) -> dict:
    ctx = batch * (args.prompt_tokens + args.decode_tokens)
    cmd = [args.llama_batched_bench, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(args.prompt_tokens), "-ntg", str(args.decode_tokens), "-npl", f"{batch},{batch}", "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **args.env})
    rows = [json.loads(line) for line in (r.stdout + r.stderr).splitlines() if line.startswith("{\"n_kv_max\"")]
    if r.returncode != 0 or not rows:
        lines = r.stderr.strip().splitlines()
        raise SystemExit(f"llama-batched-bench failed: {lines[-1] if lines else f'exit code {r.returncode}'}")
    # The same shapes twice: the first run is its warm-up (its own warms a 16-token prompt alone,
    # and its first decode steps at a new batch pay for their set-up), the second is timed.
    return {"prefill": rows[-1]["speed_pp"], "decode": rows[-1]["speed_tg"]}


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    threads = len(os.sched_getaffinity(0))
    settings = [(engine, scheme, gguf, b) for scheme, gguf in args.pairs for b in args.batches for engine in ("pocketllm", "llama.cpp")]
    figures = {s: {"prefill": [], "decode": []} for s in settings}
    steps = set()
    for rep in range(args.reps):
        for s in alternate(settings, rep):
            engine, scheme, gguf, b = s
            got = pocket(args, scheme, b) if engine == "pocketllm" else llama(args, gguf, b, threads)
            steps.add(got.pop("decode_step", None))
            for kind, value in got.items():
                figures[s][kind].append(value)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    med = {(s, k): statistics.median(v) for s, f in figures.items() for k, v in f.items()}
    print(f"machine: {compiled.cpu_model()} ({platform.machine()}), {threads} threads each; prompt {args.prompt_tokens} tokens a sequence, "
          f"{args.decode_tokens} decode steps; reps={args.reps} interleaved; aggregate tok/s median (min..max)"
          + (f"; env {' '.join(f'{k}={v}' for k, v in args.env.items())}" if args.env else "")
          + f"; pocketllm decode step: {', '.join(sorted(x for x in steps if x))}")
    print(f"{'scheme':<8}{'gguf':<22}{'B':>3}{'pocketllm prefill':>26}{'llama.cpp':>24}{'ratio':>7}{'pocketllm decode':>24}{'llama.cpp':>24}{'ratio':>7}{'xB1 ours':>10}{'xB1 theirs':>11}")
    for scheme, gguf in args.pairs:
        for b in args.batches:
            ours, theirs = ("pocketllm", scheme, gguf, b), ("llama.cpp", scheme, gguf, b)
            row = f"{scheme:<8}{os.path.basename(gguf)[:21]:<22}{b:>3}"
            for kind, digits, width in (("prefill", 1, 26), ("decode", 2, 24)):
                row += f"{spread(figures[ours][kind], digits):>{width}}{spread(figures[theirs][kind], digits):>24}"
                row += f"{med[(ours, kind)] / med[(theirs, kind)]:>7.2f}"
            one = args.batches[0]
            row += f"{med[(ours, 'decode')] / med[(('pocketllm', scheme, gguf, one), 'decode')]:>10.2f}"
            row += f"{med[(theirs, 'decode')] / med[(('llama.cpp', scheme, gguf, one), 'decode')]:>11.2f}"
            print(row)
    print(f"xB1: each engine's aggregate decode at B against its own at B={args.batches[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

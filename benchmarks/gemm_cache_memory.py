"""Resident memory under prompts of varied length, with torch's per-shape GEMM caches as an engine
bounds them, as torch leaves them, and off: each run a fresh process that builds an engine on a
preset's random weights and generates over the same prompts of random length (each a new row
count for the prefill's last chunk), reading its VmRSS as it goes; settings interleaved, the order
reversed on odd reps. Prints each setting's RSS at start, halfway and at the end, and the prompt
tokens a second, medians (min..max) over the reps (docs/serving.md).

    python benchmarks/gemm_cache_memory.py [--preset small] [--layers 4] [--prompts 100]
        [--lengths 200-1500] [--reps 2]
"""

from __future__ import annotations

import os
import sys

from common import Parser, alternate, at_least, even_reps, positive_int, run_json_line, script, spread

from pocketllm.errors import UsageError
from pocketllm.host_memory import GEMM_CACHE_ENTRIES, GEMM_CACHES

# Each setting's variables over the environment; bounded is what an engine sets when none is.
SETTINGS = {
    f"bounded ({GEMM_CACHE_ENTRIES}, the engine's)": {},
    "torch's defaults (1024)": dict.fromkeys(GEMM_CACHES, "1024"),
    "off": {"LRU_CACHE_CAPACITY": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"},
}

# One run, in a fresh process: torch reads the caches' bounds once, at its first GEMM.
RUN = """
import json, random, sys, time, torch
from pocketllm.distributed.policy import RulePolicy
from pocketllm.distributed.state import set_tp
from pocketllm.engine.generate import generate
from pocketllm.engine.runner import Engine
from pocketllm.loader.random_weights import RandomWeights
from pocketllm.presets import get_preset

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

preset, layers, n, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
set_tp(0, 1)
cfg = get_preset(preset).with_layers(layers)
engine = Engine(cfg, RandomWeights(cfg, dtype=torch.bfloat16), torch.bfloat16, torch.device("cpu"), RulePolicy())
rnd = random.Random(0)
prompts = [[rnd.randrange(cfg.vocab_size) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]
start, marks, t0 = rss_mb(), [], time.perf_counter()
for i, p in enumerate(prompts):
    generate(engine, p, 1)
    if i + 1 in (n // 2, n):
        marks.append(rss_mb())
seconds = time.perf_counter() - t0
print(json.dumps({"start": start, "half": marks[0], "end": marks[1], "tok_s": sum(map(len, prompts)) / seconds}))
"""


def parse_lengths(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        lo, hi = int(lo), int(hi)
    except ValueError:
        raise UsageError(f"--lengths takes LO-HI, got {text!r}") from None
    if not sep or not 1 <= lo <= hi:
        raise UsageError(f"--lengths takes LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def one_run(args, lo: int, hi: int, env: dict) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in GEMM_CACHES}
    cmd = [sys.executable, "-c", RUN, args.preset, str(args.layers), str(args.prompts), str(lo), str(hi)]
    return run_json_line(cmd, "a run", {**full, **env})


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--prompts", type=at_least(2), default=100, help="prompts a run generates over, RSS read halfway and at the end (default 100)")
    p.add_argument("--lengths", default="200-1500", help="prompt lengths LO-HI, drawn at random (default 200-1500)")
    p.add_argument("--reps", type=even_reps, default=2, help="runs of each setting, even so each order runs equally often (default 2)")
    args = p.parse_args(argv)
    lo, hi = parse_lengths(args.lengths)
    from pocketllm.presets import get_preset

    if hi + 1 > get_preset(args.preset).max_position_embeddings:
        raise UsageError(f"--lengths up to {hi} do not fit the {args.preset} preset's positions")
    got = {name: [] for name in SETTINGS}
    for rep in range(args.reps):
        for name in alternate(list(SETTINGS), rep):
            got[name].append(one_run(args, lo, hi, SETTINGS[name]))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(f"{args.preset} preset, {args.layers} layers, bf16, {args.prompts} prompts of {lo}-{hi} random ids, one new token each; "
          f"{args.reps} runs a setting, each a fresh process; median (min..max)")
    print(f"{'GEMM caches':<30}{'RSS MB at start':>26}{'halfway':>26}{'at the end':>26}{'prompt tok/s':>26}")
    for name, runs in got.items():
        cols = [spread([r[k] for r in runs], 0) for k in ("start", "half", "end", "tok_s")]
        print(f"{name:<30}" + "".join(f"{c:>26}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())

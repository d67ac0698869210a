"""pocketllm's quantized weights against llama.cpp's on the same weights: prefill and decode
tokens/s side by side, and how close each decode step comes to streaming its weights at the
machine's read rate.

pocketllm loads --ckpt (a float checkpoint) once per scheme in this process, quantized at load
(TP=1, the engine `pocketllm bench` runs); llama.cpp runs `llama-bench` on each GGUF given
(`llama-quantize` of the same checkpoint's bf16 GGUF), with the same thread count. Each pair is
(pocketllm scheme, GGUF), e.g. int8=small-Q8_0.gguf; scheme `none` is the checkpoint's own floats
(bf16=small-bf16.gguf also reads so). --prompt-tokens 0 times decode alone. Reps are interleaved, the order of every
setting reversed every other rep. For each setting the streaming limit is its bytes read per
decode step (every weight but the embedding table, of which a step reads one row) over the read
rate of a 1 GiB fp32 sum: decode tok/s is also given as a share of that limit.

    python benchmarks/vs_llama_cpp_quant.py --ckpt DIR --llama-bench PATH
        --pair int8=Q8_0.gguf --pair int4=Q4_0.gguf [--pair none=bf16.gguf]
        [--gguf-python PATH] [--prompt-tokens 512] [--decode-tokens 64] [--reps 4] [--threads 2]
        [--min-read-rate GB/s [--wait-seconds S]]

--min-read-rate R is for a host whose read rate moves minute to minute: after loading, each
setting's run in a rep starts when a 1 GiB sum reads at least R, and a run after which the sum
reads below R is dropped and run again before the rep moves on (the order within each rep is kept),
so that every kept figure was measured in a fast window; the limit is then the fastest sum read
around the kept runs, and `of run` adds the median over reps of each run's decode against the
slower of the two sums around that run. Out of --wait-seconds, the whole reps kept so far, in
pairs, are reported as such (reps=K of N); with fewer than two it is an error.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

from common import (
    Parser, PocketRunner, absolute_path, at_least, alternate, even_reps, executable, llama_bench_tests, machine, parse_pairs, positive_int, read_bandwidths_gbps,
    script, spread,
)
from pocketllm.bench.limits import decode_weight_bytes
from pocketllm import compiled
from pocketllm.inputs import bench_ids
from pocketllm.model_args import check_out_path

# Bytes of a GGUF's tensors a decode step reads: all but the token embedding (one row of it).
GGUF_STEP_BYTES = (
    "import sys, gguf; r = gguf.GGUFReader(sys.argv[1]); "
    "e = [t for t in r.tensors if t.name == 'token_embd.weight']; "
    "print(sum(int(t.n_bytes) for t in r.tensors if t.name != 'token_embd.weight') + sum(int(t.n_bytes) // int(t.shape[-1]) for t in e))"
)


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", required=True, type=absolute_path, help="float checkpoint pocketllm quantizes at load")
    p.add_argument("--llama-bench", required=True, type=executable)
    p.add_argument("--pair", action="append", required=True, help="SCHEME=GGUF: a pocketllm --quantize scheme and the llama.cpp file it is set against")
    p.add_argument("--gguf-python", type=executable, help="a python with the gguf package (llama.cpp's converter venv), for the GGUFs' bytes per step")
    p.add_argument("--prompt-tokens", type=at_least(0), default=512)
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument("--reps", type=even_reps, default=4)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--json")
    p.add_argument("--min-read-rate", type=float, default=0.0, help="start each setting's run when a 1 GiB sum reads at least this many GB/s, and run "
                   "it again when the sum after it reads less (on a host whose rate moves minute to minute: every kept figure measured in a fast window)")
    p.add_argument("--wait-seconds", type=float, default=1800.0, help="how long --min-read-rate may wait in all (default 1800); then the whole reps kept so far, in pairs, are the result")
    args = p.parse_args(argv)
    args.pairs = parse_pairs(p, args.pair)
    return args


class Pocket(PocketRunner):
    def __init__(self, ckpt: str, scheme: str):
        super().__init__(ckpt, "bfloat16", scheme)
        self.describe = self.cfg.weights.describe() if self.cfg.weights else "weights as stored (bf16)"
        self.step_bytes = decode_weight_bytes(self.engine.model)

    def run(self, prompt: list[int], first: list[int], n: int) -> dict:
        out = {}
        if prompt:
            out["prefill"] = len(prompt) / self.prefill(prompt)
        out["decode"] = n / self.decode(first, n)[0]
        return out


class Llama:
    def __init__(self, binary: str, gguf: str, threads: int, prompt: int, n: int, gguf_python: str | None):
        self.cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(n), "-r", "1", "-o", "json"]
        self.version = ""
        self.step_bytes = None
        if gguf_python:
            r = subprocess.run([gguf_python, "-c", GGUF_STEP_BYTES, gguf], capture_output=True, text=True, check=True)
            self.step_bytes = int(r.stdout.strip())

    def run(self, *_) -> dict:
        out = {}
        for test in llama_bench_tests(self.cmd):
            self.version = test.get("build_commit", "?")
            if test["n_prompt"] or test["n_gen"]:
                out["prefill" if test["n_prompt"] else "decode"] = test["avg_ts"]
        return out


def _read_rate(reps: int = 5) -> float:
    return max(read_bandwidths_gbps(reps=reps).values())


def held_run(args, setting, prompt: list[int], first: list[int], deadline: float, label: str):
    """One setting's run in a fast window (--min-read-rate): (its figures, the sums before and
    after it, how many tries were dropped), run again while the sum after it reads slow; None
    once --wait-seconds is out."""
    floor, dropped = args.min_read_rate, 0
    while True:
        before = _read_rate(2)
        while before < floor:
            if time.monotonic() > deadline:
                return None
            time.sleep(2)
            before = _read_rate(2)
        got = setting.run(prompt, first, args.decode_tokens)
        after = _read_rate(2)
        if after >= floor:
            return got, (before, after), dropped
        dropped += 1
        print(f"{label}: dropped, the sum read {before:.1f} GB/s before it and {after:.1f} after", file=sys.stderr, flush=True)


def run_reps(args, settings: dict, figures: dict, prompt: list[int], first: list[int]) -> tuple[dict, int, int]:
    """The reps, each setting once per rep in alternating order, into `figures`: (the (before,
    after) sums around each kept run per setting, with --min-read-rate; how many runs were
    dropped; how many whole reps were kept). Out of --wait-seconds, the whole reps kept so far, in
    pairs so that each order still runs as often as the other, are the result (none: an error)."""
    deadline = time.monotonic() + args.wait_seconds
    around, dropped = {name: [] for name in settings}, 0
    for rep in range(args.reps):
        for name in alternate(list(settings), rep):
            if not args.min_read_rate:
                got = settings[name].run(prompt, first, args.decode_tokens)
            else:
                label = f"rep {rep + 1}/{args.reps}, {name}"
                tries = held_run(args, settings[name], prompt, first, deadline, label)
                if tries is None:
                    why = f"the read rate stayed below {args.min_read_rate} GB/s for {args.wait_seconds:.0f} s"
                    kept = rep - rep % 2
                    if kept == 0:
                        raise SystemExit(f"{why}; {rep} whole rep(s) kept, not two")
                    print(f"stopped after {kept} of {args.reps} reps: {why}", file=sys.stderr, flush=True)
                    for s in settings:
                        around[s] = around[s][:kept]
                        figures[s] = {kind: values[:kept] for kind, values in figures[s].items()}
                    return around, dropped, kept
                got, sums, tried = tries
                around[name].append(sums)
                dropped += tried
            for kind, value in got.items():
                figures[name][kind].append(value)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    return around, dropped, args.reps


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    check_out_path(args.json, "--json", args.ckpt)
    torch.set_num_threads(args.threads)
    settings: dict[str, object] = {}
    names = []
    for scheme, gguf in args.pairs:
        ours, theirs = f"pocketllm {'bf16' if scheme == 'none' else scheme}", f"llama.cpp {gguf.rsplit('/', 1)[-1]}"
        names.append((ours, theirs))
        if ours not in settings:
            settings[ours] = Pocket(args.ckpt, scheme)
        settings[theirs] = Llama(args.llama_bench, gguf, args.threads, args.prompt_tokens, args.decode_tokens, args.gguf_python)
    vocab = next(s for s in settings.values() if isinstance(s, Pocket)).engine.cfg.vocab_size
    prompt = bench_ids(args.prompt_tokens, vocab) if args.prompt_tokens else []
    first = bench_ids(1, vocab)
    for s in settings.values():
        if isinstance(s, Pocket):
            s.run(prompt, first, 2)  # warm-up: the first pass at a shape pays for its setup
    figures = {name: {"prefill": [], "decode": []} for name in settings}
    # Held, the sums around each kept run; else one sum before the reps and one after.
    first_sum = [] if args.min_read_rate else [_read_rate()]
    around, dropped, kept = run_reps(args, settings, figures, prompt, first)
    rates = [r for runs in around.values() for sums in runs for r in sums] if args.min_read_rate else first_sum + [_read_rate()]
    rate = max(rates) * 1e9
    llama_version = next((s.version for s in settings.values() if isinstance(s, Llama)), "")
    print(f"{machine()}, llama.cpp {llama_version}")
    held = f"; each setting's run in a rep made while the sum read >= {args.min_read_rate:g} GB/s before and after it, {dropped} run(s) dropped" if args.min_read_rate else ""
    print(f"threads={args.threads} reps={kept}{'' if kept == args.reps else f' of {args.reps} (out of --wait-seconds)'} (median, min..max); read rate (1 GiB fp32 sum, best around the reps) {rate / 1e9:.1f} GB/s "
          f"(sums read {min(rates):.1f}..{max(rates):.1f}{held})")
    for s in settings.values():
        if isinstance(s, Pocket):
            print(s.describe)
    print(f"{'setting':<28}{'prefill tok/s @' + str(args.prompt_tokens):>26}{'decode tok/s':>24}{'MB/step':>9}{'limit tok/s':>12}{'of limit':>9}"
          + (f"{'of run':>8}" if args.min_read_rate else ""))
    summary = {
        "machine": compiled.cpu_model(), "threads": args.threads, "reps": kept, "read_GBps": round(rate / 1e9, 2),
        "min_read_GBps": args.min_read_rate, "dropped_runs": dropped, "settings": {},
    }
    for name, s in settings.items():
        pre, dec = figures[name]["prefill"], figures[name]["decode"]
        limit = rate / s.step_bytes if s.step_bytes else None
        share = f"{statistics.median(dec) / limit:.0%}" if limit else "-"
        mb = f"{s.step_bytes / 1e6:.0f}" if s.step_bytes else "-"
        # Held runs: also each run's decode against the slower of the two sums around that run.
        per_run = statistics.median(d * s.step_bytes / (min(ab) * 1e9) for d, ab in zip(dec, around[name])) if around[name] and s.step_bytes else None
        print(f"{name:<28}{(spread(pre) if pre else '-'):>26}{spread(dec, 2):>24}{mb:>9}{(f'{limit:.1f}' if limit else '-'):>12}{share:>9}"
              + (f"{per_run:>8.0%}" if per_run is not None else ""))
        summary["settings"][name] = {
            "prefill": round(statistics.median(pre), 2) if pre else None, "decode": round(statistics.median(dec), 2),
            "step_bytes": s.step_bytes, "limit_tok_s": round(limit, 2) if limit else None,
            "of_run_limit": round(per_run, 3) if per_run is not None else None,
        }
    print("pocketllm over llama.cpp (ratio of medians)")
    summary["ratios"] = {}
    for ours, theirs in names:
        r = {k: round(statistics.median(figures[ours][k]) / statistics.median(figures[theirs][k]), 3) for k in ("prefill", "decode") if figures[ours][k] and figures[theirs][k]}
        summary["ratios"][f"{ours} / {theirs}"] = r
        print(f"  {ours} / {theirs}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    own = figures.get("pocketllm bf16", {}).get("prefill")
    if own:
        for ours in dict(names):
            if ours != "pocketllm bf16" and figures[ours]["prefill"]:
                r = round(statistics.median(figures[ours]["prefill"]) / statistics.median(own), 3)
                summary["ratios"][f"{ours} / pocketllm bf16"] = {"prefill": r}
                print(f"  {ours} / pocketllm bf16: prefill {r:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "summary": summary}, f, indent=2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

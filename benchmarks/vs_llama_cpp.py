"""pocketllm against llama.cpp on the same weights: prefill and decode tokens/s side by side.

pocketllm loads --ckpt once in this process (TP=1, the engine `pocketllm bench` runs); llama.cpp
runs as `llama-bench` on --gguf, the same checkpoint converted to GGUF (../shared/peers/llama-cpp
says how to build it and convert), with the same thread count. Repetitions are interleaved, the
engines' order reversed every other rep: each rep times pocketllm's prefill at every length and a
decode of --decode-tokens, and one llama-bench run of the same tests (`-p LENGTHS -n N -r 1`).
Prints medians with min..max, the ratios, which one-row kernels pocketllm chose, and a JSON last
line.

    python benchmarks/vs_llama_cpp.py --ckpt DIR --gguf FILE --llama-bench PATH
        [--lengths 512,2048] [--decode-tokens 64] [--reps 4] [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from common import Parser, PocketRunner, absolute_path, alternate, even_reps, executable, existing_file, int_list, llama_bench_tests, machine, positive_int, script, spread
from pocketllm import compiled
from pocketllm.inputs import bench_ids
from pocketllm.model_args import check_out_path, parse_dtype


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", required=True, type=absolute_path, help="HF checkpoint directory pocketllm loads")
    p.add_argument("--gguf", required=True, type=existing_file, help="the same checkpoint as GGUF, for llama.cpp")
    p.add_argument("--llama-bench", required=True, type=executable, help="path of the llama-bench binary")
    p.add_argument("--lengths", type=int_list(1), default="512,2048", help="prefill lengths (default 512,2048)")
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument("--reps", type=even_reps, default=4, help="reps per engine, even so each runs first equally often (default 4)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="pocketllm's dtype; match the GGUF's (default bfloat16)")
    p.add_argument("--json", help="write every rep and the summary here")
    return p.parse_args(argv)


class LlamaBench:
    name = "llama.cpp"

    def __init__(self, binary: str, gguf: str, threads: int, lengths: list[int], decode_tokens: int):
        self.cmd = [binary, "-m", gguf, "-t", str(threads), "-p", ",".join(map(str, lengths)), "-n", str(decode_tokens), "-r", "1", "-o", "json"]
        self.version = ""

    def run(self) -> dict:
        """{("prefill", n): tok/s, ("decode", n): tok/s} from one llama-bench run."""
        out = {}
        for test in llama_bench_tests(self.cmd):
            self.version = f"{test.get('build_commit', '?')}"
            kind, n = ("prefill", test["n_prompt"]) if test["n_prompt"] else ("decode", test["n_gen"])
            out[(kind, n)] = test["avg_ts"]
        return out


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = parse_dtype(args.dtype)
    check_out_path(args.json, "--json", args.ckpt)
    torch.set_num_threads(args.threads)
    lengths = args.lengths
    pocket = PocketRunner(args.ckpt, dtype)
    llama = LlamaBench(args.llama_bench, args.gguf, args.threads, lengths, args.decode_tokens)
    vocab = pocket.engine.cfg.vocab_size
    prompts = {n: bench_ids(n, vocab) for n in lengths}
    # llama-bench's decode starts from an empty context: pocketllm's from a one-token prompt.
    first = bench_ids(1, vocab)
    # Warm-up at every timed length: a first pass at a shape pays for per-shape setup.
    for n in lengths:
        pocket.prefill(prompts[n])
    pocket.decode(first, 2)

    def run_pocket() -> dict:
        out = {("prefill", n): n / pocket.prefill(prompts[n]) for n in lengths}
        seconds, _ = pocket.decode(first, args.decode_tokens)
        out[("decode", args.decode_tokens)] = args.decode_tokens / seconds
        return out

    runs = {"pocketllm": run_pocket, "llama.cpp": llama.run}
    figures: dict[str, dict[tuple[str, int], list[float]]] = {name: {} for name in runs}
    for rep in range(args.reps):
        for name in alternate(list(runs), rep):
            for key, value in runs[name]().items():
                figures[name].setdefault(key, []).append(value)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

    print(f"{machine()}, llama.cpp {llama.version}")
    print(f"threads={args.threads} dtype={args.dtype} reps={args.reps} (median, min..max)")
    print("\n".join(pocket.engine.kernels.describe()))
    print(pocket.engine.model.decode_ops.describe())
    print(f"{'measure':<22}{'pocketllm':>26}{'llama.cpp':>26}{'ratio':>8}")
    summary = {"machine": compiled.cpu_model(), "threads": args.threads, "reps": args.reps}
    keys = [("prefill", n) for n in lengths] + [("decode", args.decode_tokens)]
    for kind, n in keys:
        a, b = figures["pocketllm"][(kind, n)], figures["llama.cpp"][(kind, n)]
        ratio = statistics.median(a) / statistics.median(b)
        label = f"prefill tok/s @{n}" if kind == "prefill" else f"decode tok/s x{n}"
        summary[f"{kind}_{n}"] = {"pocketllm": round(statistics.median(a), 2), "llama.cpp": round(statistics.median(b), 2), "ratio": round(ratio, 3)}
        print(f"{label:<22}{spread(a):>26}{spread(b):>26}{ratio:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: {f"{k}@{n}": v for (k, n), v in figs.items()} for name, figs in figures.items()} | {"summary": summary}, f, indent=2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

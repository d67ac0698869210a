"""Decode at long context: pocketllm against llama.cpp at the same depths, and where a step's time goes.

pocketllm loads --ckpt once in this process (TP=1, the engine `pocketllm bench` runs) and prefills
one sequence per depth (--depths, each in its own slot, untimed); each rep then times
--decode-tokens greedy steps of every sequence, each continuing where its last rep stopped (so a
depth's sequence grows by that many positions a rep). llama.cpp runs as `llama-bench -p 0 -n N -d
DEPTHS -r 1` on --gguf, the same checkpoint as GGUF, with the same thread count (it prefills each
depth afresh, outside its timing). Reps are interleaved, the engines' order reversed every other
rep. Prints median (min..max) tok/s per depth and engine, each depth against the first, the ratio
of the engines, and a JSON last line.

--profile: after the reps, pocketllm's steps at each depth once more under the scope recorder
(pocketllm.profiling.scopes, host clock, no synchronisation, exclusive times): ms per step per
scope at each depth, and what each costs more than at the first depth, largest first; the
loss at a long context is in the rows at the top.

    python benchmarks/long_context.py --ckpt DIR --gguf FILE --llama-bench PATH
        [--depths 64,8000,16384] [--decode-tokens 32] [--reps 4] [--threads 2] [--profile]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from common import (
    Parser, PocketRunner, absolute_path, alternate, even_reps, executable, existing_file, int_list, llama_bench_tests, machine, positive_int,
    read_bandwidths_gbps, script, spread,
)
from pocketllm.bench.limits import decode_weight_bytes
from pocketllm import compiled
from pocketllm.config import load_config
from pocketllm.errors import UsageError
from pocketllm.inputs import bench_ids
from pocketllm.layers.kv_layout import kv_block_bytes
from pocketllm.model_args import check_out_path, parse_dtype
from pocketllm.profiling import scopes


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", required=True, type=absolute_path, help="HF checkpoint directory pocketllm loads")
    p.add_argument("--gguf", type=existing_file, help="the same checkpoint as GGUF, for llama.cpp (with --llama-bench)")
    p.add_argument("--llama-bench", type=executable, help="path of the llama-bench binary (without it, pocketllm alone)")
    p.add_argument("--depths", type=int_list(1), default="64,8000,16384", help="context lengths decode starts from (default 64,8000,16384)")
    p.add_argument("--decode-tokens", type=positive_int, default=32)
    p.add_argument("--reps", type=even_reps, default=4, help="reps per engine, even so each runs first equally often (default 4)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="pocketllm's dtype; match the GGUF's (default bfloat16)")
    p.add_argument("--profile", action="store_true", help="also time pocketllm's steps per scope at each depth")
    p.add_argument("--json", help="write every rep and the summary here")
    args = p.parse_args(argv)
    if (args.gguf is None) != (args.llama_bench is None):
        p.error("--gguf and --llama-bench go together")
    return args


def positions_needed(depths: list[int], steps: int, reps: int) -> int:
    """A sequence's positions: the deepest, and room for every timed rep, the warm-up run, and the
    profile's warm-up and profiled runs."""
    return max(depths) + (reps + 3) * steps + 1


class PocketDepths:
    """One sequence per depth in the engine's slots, decoded a run of steps at a time."""

    def __init__(self, runner: PocketRunner, depths: list[int], steps: int, reps: int):
        self.engine, self.depths, self.steps = runner.engine, depths, steps
        vocab = self.engine.cfg.vocab_size
        self.engine.reserve_slots(len(depths), positions_needed(depths, steps, reps))
        self.token, self.pos = {}, {}
        for slot, depth in enumerate(depths):
            print(f"pocketllm: prefilling {depth} tokens", file=sys.stderr, flush=True)
            logits = self.engine.run_packed([(slot, 0, torch.tensor(bench_ids(depth, vocab), dtype=torch.long))])[0]
            self.token[depth], self.pos[depth] = int(torch.argmax(logits)), depth

    def decode(self, depth: int) -> float:
        """Seconds of self.steps greedy steps of the depth's sequence, from where it stands."""
        # Each depth's sequence is held in its own slot between runs, out of the others' passes,
        # which the generation loop's scheduler (every sequence it runs in every pass) does not
        # do: the steps go to the engine's decode row here, the call its decode steps make.
        pos, slot, token = self.pos[depth], self.depths.index(depth), self.token[depth]
        t0 = time.perf_counter()
        for step in range(self.steps):
            token = self.engine.greedy_row(slot, pos + step, token)
        seconds = time.perf_counter() - t0
        self.token[depth], self.pos[depth] = token, pos + self.steps
        return seconds

    def run(self, rep: int) -> dict[int, float]:
        # The depths' order alternates too: the first timed after the other engine ran is slower.
        return {d: self.steps / self.decode(d) for d in alternate(self.depths, rep)}

    def profile(self) -> dict[int, dict[str, float]]:
        """At each depth, ms per step of every scope (exclusive; "other" is the step outside any
        scope). Every depth runs once untimed under a recorder first: a first run under it pays
        for its setup, which made the first depth profiled the slowest and the "+" column negative."""
        self._recorded(self.depths)
        return {d: self._per_step(self._recorded([d])) for d in self.depths}

    def _recorded(self, depths: list[int]) -> scopes.ScopeRecorder:
        recorder = scopes.ScopeRecorder()
        scopes.install(recorder)
        try:
            with scopes.scope(scopes.STACK):
                for depth in depths:
                    self.decode(depth)
        finally:
            scopes.install(None)
        return recorder

    def _per_step(self, recorder: scopes.ScopeRecorder) -> dict[str, float]:
        out = {}
        for (name, site), (exclusive, _, _) in recorder.stats.items():
            label = "other" if name == scopes.STACK else f"{name}/{site}" if site else name
            out[label] = out.get(label, 0.0) + exclusive / 1e6 / self.steps
        return out


class LlamaDepths:
    def __init__(self, binary: str, gguf: str, threads: int, depths: list[int], steps: int):
        self.cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(steps), "-d", ",".join(map(str, depths)), "-r", "1", "-o", "json"]
        self.version = ""

    def run(self, rep: int) -> dict[int, float]:
        out = {}
        for test in llama_bench_tests(self.cmd):
            self.version = str(test.get("build_commit", "?"))
            out[test["n_depth"]] = test["avg_ts"]
        return out


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = parse_dtype(args.dtype)
    check_out_path(args.json, "--json", args.ckpt)
    depths = args.depths
    limit, needed = load_config(args.ckpt).max_position_embeddings, positions_needed(depths, args.decode_tokens, args.reps)
    if needed > limit:
        raise UsageError(f"--depths up to {max(depths)} and {args.reps} reps of {args.decode_tokens} --decode-tokens need "
                         f"{needed} positions, over the model's {limit}")
    torch.set_num_threads(args.threads)
    pocket = PocketDepths(PocketRunner(args.ckpt, dtype), depths, args.decode_tokens, args.reps)
    for d in depths:
        pocket.decode(d)
    runs = {"pocketllm": pocket.run}
    if args.llama_bench:
        llama = LlamaDepths(args.llama_bench, args.gguf, args.threads, depths, args.decode_tokens)
        runs["llama.cpp"] = llama.run
    figures: dict[str, dict[int, list[float]]] = {name: {d: [] for d in depths} for name in runs}
    for rep in range(args.reps):
        for name in alternate(list(runs), rep):
            for depth, value in runs[name](rep).items():
                figures[name][depth].append(value)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

    engine = pocket.engine
    read_gbps = max(read_bandwidths_gbps().values())
    cfg = engine.cfg
    kv_bytes_per_token = kv_block_bytes(cfg, 1, engine.dtype.itemsize, block_size=1)
    weight_bytes = decode_weight_bytes(engine.model)
    print(machine() + (f", llama.cpp {llama.version}" if args.llama_bench else ""))
    print(f"threads={args.threads} dtype={args.dtype} reps={args.reps} decode tokens={args.decode_tokens}; decode tok/s, median (min..max)")
    print("\n".join(engine.kernels.describe()))
    print(engine.model.decode_ops.describe())
    print(f"streaming limit: {weight_bytes / 2**20:.1f} MiB of weights + {kv_bytes_per_token} B of KV cache per token of context a step, "
          f"at {read_gbps:.1f} GB/s (1 GiB fp32 sum, best of 5); limit% = tok/s x bytes per step / that rate")
    names = list(runs)
    print(f"{'depth':>7}" + "".join(f"{n:>24}{'vs ' + str(depths[0]):>9}{'limit%':>8}" for n in names) + ("   pocketllm/llama.cpp" if len(names) > 1 else ""))
    summary = {"machine": compiled.cpu_model(), "threads": args.threads, "reps": args.reps, "decode_tokens": args.decode_tokens, "read_gbps": round(read_gbps, 1)}
    for d in depths:
        row, entry = f"{d:>7}", {}
        for n in names:
            med = statistics.median(figures[n][d])
            rel = med / statistics.median(figures[n][depths[0]])
            row += f"{spread(figures[n][d]):>24}{rel:>9.2f}"
            limit = med * (weight_bytes + kv_bytes_per_token * d) / (read_gbps * 1e9)
            row += f"{limit:>8.0%}"
            entry[n] = {"tok_s": round(med, 2), f"vs_{depths[0]}": round(rel, 3), "of_limit": round(limit, 3)}
        if len(names) > 1:
            # Per rep, the two engines' figures of the same rep.
            ratios = [a / b for a, b in zip(figures["pocketllm"][d], figures["llama.cpp"][d])]
            row += f"   {statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
            entry["ratio"] = round(statistics.median(ratios), 3)
        summary[str(d)] = entry
        print(row)
    if args.profile:
        profiles = pocket.profile()
        base = profiles[depths[0]]
        labels = sorted(set().union(*profiles.values()), key=lambda k: -(profiles[depths[-1]].get(k, 0) - base.get(k, 0)))
        print(f"ms per step by scope (exclusive, host clock, one run of {args.decode_tokens} steps each; + is more than at {depths[0]})")
        print(f"{'scope':<28}" + "".join(f"{d:>10}" for d in depths) + "".join(f"{'+' + str(d):>10}" for d in depths[1:]))
        for k in labels:
            print(f"{k:<28}" + "".join(f"{profiles[d].get(k, 0):>10.3f}" for d in depths) + "".join(f"{profiles[d].get(k, 0) - base.get(k, 0):>+10.3f}" for d in depths[1:]))
        print(f"{'step':<28}" + "".join(f"{sum(profiles[d].values()):>10.3f}" for d in depths))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: {str(d): v for d, v in figs.items()} for name, figs in figures.items()} | {"summary": summary}, f, indent=2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

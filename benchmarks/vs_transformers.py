"""pocketllm against transformers on the same safetensors checkpoint, side by side in one process.

Same checkpoint, dtype and thread count, TP=1, repetitions interleaved (every engine and length once
per rep, the engines' order reversed every other rep). Prints prefill tokens/s at each prompt length
and decode tokens/s over --decode-tokens, as medians with min..max and as ratios; compares the
greedy tokens; and prints the weight-streaming limit of a decode step (the weight bytes one step
reads divided by the machine's measured memory read bandwidth) with pocketllm's share of it, and the
rate of a step cut down to its GEMVs alone (what no fusion of the rest can beat).

    python benchmarks/vs_transformers.py [--ckpt DIR | --preset small] [--lengths 512,2048]
        [--decode-tokens 64] [--reps 4] [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from common import PocketRunner, alternate, checkpoint_dir, decode_weight_bytes, gemv_only_step_seconds, projection_weights, read_bandwidths_gbps, spread, tensor_bytes
from pocketllm.model_args import parse_dtype


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="HF checkpoint directory (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=4, help="reps per engine, even so each runs first equally often (default 4)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write every rep and the summary here")
    return p.parse_args(argv)


class HFRunner:
    name = "transformers"

    def __init__(self, ckpt: str, dtype: torch.dtype):
        from transformers import Qwen3_5ForCausalLM

        self.model = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    @torch.no_grad()
    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        token = int(torch.argmax(out.logits[0, -1]))
        tokens = [token]
        t0 = time.perf_counter()
        for _ in range(n):
            out = self.model(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            token = int(torch.argmax(out.logits[0, -1]))
            tokens.append(token)
        return time.perf_counter() - t0, tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    ckpt = checkpoint_dir(args)
    from pocketllm.inputs import bench_ids

    runners = [PocketRunner(ckpt, dtype), HFRunner(ckpt, dtype)]
    vocab = runners[0].engine.cfg.vocab_size
    prompts = {n: bench_ids(n, vocab) for n in lengths}
    decode_prompt = bench_ids(32, vocab)
    # Warm-up at every timed length: a first pass at a shape pays for per-shape setup.
    for r in runners:
        for n in lengths:
            r.prefill(prompts[n])
        r.decode(decode_prompt, 2)
    prefill = {(r.name, n): [] for r in runners for n in lengths}
    decode = {r.name: [] for r in runners}
    tokens = {}
    for rep in range(args.reps):
        order = alternate(runners, rep)
        for n in lengths:
            for r in order:
                prefill[(r.name, n)].append(n / r.prefill(prompts[n]))
        for r in order:
            seconds, toks = r.decode(decode_prompt, args.decode_tokens)
            decode[r.name].append(args.decode_tokens / seconds)
            tokens[r.name] = toks
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

    print(f"threads={args.threads} dtype={args.dtype} reps={args.reps} (median, min..max)")
    print(f"{'measure':<22}{'pocketllm':>26}{'transformers':>26}{'ratio':>8}")
    summary = {}
    for n in lengths:
        a, b = prefill[("pocketllm", n)], prefill[("transformers", n)]
        ratio = statistics.median(a) / statistics.median(b)
        summary[f"prefill_{n}_ratio"] = round(ratio, 3)
        print(f"{f'prefill tok/s @{n}':<22}{spread(a):>26}{spread(b):>26}{ratio:>8.2f}")
    a, b = decode["pocketllm"], decode["transformers"]
    ratio = statistics.median(a) / statistics.median(b)
    summary["decode_ratio"] = round(ratio, 3)
    print(f"{f'decode tok/s x{args.decode_tokens}':<22}{spread(a):>26}{spread(b):>26}{ratio:>8.2f}")
    weight_bytes = decode_weight_bytes(runners[0].engine.model)
    bandwidth = max(read_bandwidths_gbps().values())
    limit = bandwidth * 1e9 / weight_bytes
    summary["decode_streaming_limit_tok_s"] = round(limit, 1)
    summary["decode_fraction_of_limit"] = round(statistics.median(a) / limit, 3)
    print(
        f"decode weight bytes/step={weight_bytes / 2**20:.1f} MiB  read bandwidth={bandwidth:.1f} GB/s  "
        f"streaming limit={limit:.1f} tok/s  pocketllm at {100 * statistics.median(a) / limit:.0f}% of it"
    )
    gemv_step = gemv_only_step_seconds(runners[0].engine.model)
    summary["gemv_only_step_tok_s"] = round(1.0 / gemv_step, 1)
    summary["gemv_only_fraction_of_limit"] = round(1.0 / gemv_step / limit, 3)
    # That step reads only the projection and head weights, not the norms and the rest that
    # weight_bytes (and so the limit) counts: its bandwidth is theirs over its time.
    gemv_bytes = tensor_bytes(projection_weights(runners[0].engine.model))
    print(
        f"a step of its GEMVs alone: {gemv_step * 1e3:.1f} ms = {1.0 / gemv_step:.1f} tok/s, "
        f"{100 / gemv_step / limit:.0f}% of the limit ({gemv_bytes / 2**20:.1f} of the step's "
        f"{weight_bytes / 2**20:.1f} MiB at {gemv_bytes / gemv_step / 1e9:.1f} GB/s)"
    )
    same = sum(1 for x, y in zip(tokens["pocketllm"], tokens["transformers"]) if x == y)
    first_diff = next((i for i, (x, y) in enumerate(zip(tokens["pocketllm"], tokens["transformers"])) if x != y), None)
    summary["greedy_tokens_equal"] = first_diff is None
    print(f"greedy tokens: {same}/{len(tokens['pocketllm'])} equal" + ("" if first_diff is None else f", first difference at step {first_diff}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prefill_tok_s": {f"{k[0]}@{k[1]}": v for k, v in prefill.items()}, "decode_tok_s": decode, "summary": summary}, f, indent=2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""pocketllm against transformers on the same safetensors checkpoint, side by side in one process.

Same checkpoint, dtype and thread count, TP=1, repetitions interleaved (every engine and length once
per rep, in a fixed order). Prints prefill tokens/s at each prompt length and decode tokens/s over
--decode-tokens, as medians with min..max and as ratios; compares the greedy tokens; and prints the
weight-streaming limit of a decode step (the weight bytes one step reads divided by the machine's
measured memory read bandwidth) with pocketllm's share of it, and the rate of a step cut down to
its GEMVs alone (what no fusion of the rest can beat).

    python benchmarks/vs_transformers.py [--ckpt DIR | --preset small] [--lengths 512,2048]
        [--decode-tokens 64] [--reps 3] [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from pocketllm.commands.bench import timed_prefill
from pocketllm.model_args import parse_dtype


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="HF checkpoint directory (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write every rep and the summary here")
    return p.parse_args(argv)


def read_bandwidth_gbps(mib: int = 1024, reps: int = 5) -> float:
    """Memory read bandwidth: the best of a few full fp32 sums over a buffer far beyond cache, on
    huge pages (where the engine keeps its weights) or plain pages, whichever reads faster."""
    return max(read_bandwidths_gbps(mib, reps).values())


def read_bandwidths_gbps(mib: int = 1024, reps: int = 5) -> dict[str, float]:
    """{"huge pages": GB/s, "plain pages": GB/s}, each the best of `reps` sums, interleaved."""
    from pocketllm import host_memory

    n = mib * 2**20 // 4
    buffers = {"huge pages": host_memory.zeros((n,), torch.float32).fill_(1), "plain pages": torch.ones(n, dtype=torch.float32)}
    best = dict.fromkeys(buffers, float("inf"))
    for _ in range(reps):
        for name, x in buffers.items():
            t0 = time.perf_counter()
            x.sum()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: n * 4 / seconds / 1e9 for name, seconds in best.items()}


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter except the embedding table, of
    which a step reads one row (a tied head reads it whole, as the head)."""
    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "embed" in name and not model.cfg.tie_word_embeddings:
            total += p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def projection_weights(model) -> list[torch.Tensor]:
    """Every weight a decode step reads through a GEMV: the projections, then the head."""
    from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear

    weights = [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    return weights + [model.lm_head.weight]


def gemv_only_step_seconds(model, reps: int = 5, op=None) -> float:
    """A decode step cut down to its GEMVs: op(x, w) for a single row x over the model's own
    projection and head weights, in module order, and nothing else; best of `reps` passes after
    one warm-up pass. `op` defaults to the engine's single-row GEMV (pocketllm.ops.gemm), which
    makes this the fastest a step can be with that GEMV on this machine, whatever else is fused;
    any other op (decode_anatomy passes F.linear) is timed the same way, so the figures compare."""
    if op is None:
        from pocketllm.ops.gemm import linear_rows as op

    weights = projection_weights(model)
    rows = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for x, w in zip(rows, weights):
            op(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


def run_bench_json(bench_args: list[str], env: dict[str, str] | None = None, cwd=None) -> dict:
    """`python -m pocketllm bench *bench_args --json FILE` in a fresh process, and FILE's contents.

    `env` holds variables set over this process's environment; `cwd` is where the command runs,
    which also decides which tree `-m pocketllm` imports (the working directory comes first on
    sys.path). A failed run ends this process with the bench's last line of stderr."""
    with tempfile.TemporaryDirectory(prefix="pocketllm-bench-json-") as tmp:
        path = f"{tmp}/bench.json"
        cmd = [sys.executable, "-m", "pocketllm", "bench", *bench_args, "--json", path]
        r = subprocess.run(cmd, check=False, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True)
        if r.returncode != 0:
            lines = r.stderr.strip().splitlines()
            raise SystemExit(f"pocketllm bench failed: {lines[-1]}" if lines else f"pocketllm bench failed with exit code {r.returncode} and no message")
        with open(path) as f:
            return json.load(f)


class PocketRunner:
    name = "pocketllm"

    def __init__(self, ckpt: str, dtype: torch.dtype):
        from pocketllm.config import load_config
        from pocketllm.distributed.policy import RulePolicy
        from pocketllm.distributed.state import set_tp
        from pocketllm.engine.runner import Engine
        from pocketllm.loader.checkpoint import CheckpointReader

        set_tp(0, 1)
        cfg = load_config(ckpt)
        self.engine = Engine(cfg, CheckpointReader(ckpt), dtype, torch.device("cpu"), RulePolicy())

    def prefill(self, ids: list[int]) -> float:
        return timed_prefill(self.engine, ids, _no_sync, room=1)[0]

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        _, logits = timed_prefill(self.engine, ids, _no_sync, room=n + 1)
        token = int(torch.argmax(logits))
        out = [token]
        t0 = time.perf_counter()
        for _ in range(n):
            token = int(torch.argmax(self.engine.decode(token)))
            out.append(token)
        return time.perf_counter() - t0, out


def _no_sync() -> None:
    """CPU ops are synchronous: nothing to wait for around a timing."""


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


def spread(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):{7 + digits}.{digits}f} ({min(xs):.{digits}f}..{max(xs):.{digits}f})"


def checkpoint_dir(args) -> str:
    """--ckpt, or --preset written as a checkpoint in a temporary directory, removed when the
    process exits: both engines (and every benchmark here) read the same safetensors."""
    if args.ckpt is not None:
        return args.ckpt
    from pocketllm.cli import main as cli

    ckpt = tempfile.mkdtemp(prefix="pocketllm-bench-")
    atexit.register(shutil.rmtree, ckpt, ignore_errors=True)
    cli(["make-checkpoint", "--preset", args.preset, "--out", ckpt, "--dtype", args.dtype])
    return ckpt


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
    for r in runners:
        r.prefill(prompts[lengths[0]][:64])
        r.decode(decode_prompt, 2)
    prefill = {(r.name, n): [] for r in runners for n in lengths}
    decode = {r.name: [] for r in runners}
    tokens = {}
    for rep in range(args.reps):
        for n in lengths:
            for r in runners:
                prefill[(r.name, n)].append(n / r.prefill(prompts[n]))
        for r in runners:
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
    bandwidth = read_bandwidth_gbps()
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
    gemv_bytes = sum(w.numel() * w.element_size() for w in projection_weights(runners[0].engine.model))
    print(
        f"a step of its GEMVs alone: {gemv_step * 1e3:.1f} ms = {1.0 / gemv_step:.1f} tok/s, "
        f"{100 / gemv_step / limit:.0f}% of the limit ({gemv_bytes / gemv_step / 1e9:.1f} GB/s)"
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

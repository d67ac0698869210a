"""pocketllm against transformers on the same safetensors checkpoint, side by side in one process.

Same checkpoint, dtype and thread count, TP=1, repetitions interleaved (every engine and length once
per rep, the engines' order reversed every other rep). Prints prefill tokens/s at each prompt length
and decode tokens/s over --decode-tokens, as medians with min..max and as ratios; compares the
greedy tokens; and prints the weight-streaming limit of a decode step (the weight bytes one step
reads divided by the machine's measured memory rate) with pocketllm's share of it, each prefill's
share of the matmul limit (its GEMM FLOPs over a measured matmul rate), and on a CPU the rate of a
step cut down to its GEMVs alone (what no fusion of the rest can beat).

On a device (--device cuda), transformers runs with whatever kernels it finds (fla's, where the
cuda extra installed it); on a CPU with its torch forms, fla installed or not (fla's kernels take
device tensors only). --random-weights skips the checkpoint for big shapes: each engine draws
its own random weights at the preset's shapes on the device (the speeds compare; the tokens do not).

    python benchmarks/vs_transformers.py [--ckpt DIR | --preset small [--layers N] [--random-weights]]
        [--device cpu|cuda|npu] [--lengths 512,2048] [--decode-tokens 64] [--reps 4] [--dtype bfloat16] [--threads 2]
        [--kernel-profile]
    python benchmarks/vs_transformers.py --device cuda ... --warm-up-only [--engine pocketllm|transformers]
        # the warm-up alone, untimed: fills Triton's on-disk cache with the kernels a timed run compiles
"""

from __future__ import annotations

import inspect
import json
import statistics
import sys
import time

import torch

from common import (
    Parser, PocketRunner, absolute_path, alternate, checkpoint_dir, device_sync, even_reps, gemv_only_step_seconds, int_list, machine,
    one_rank_plan, positive_int, projection_weights, script, spread, tensor_bytes,
)
from pocketllm.bench import limits, transformers_model
from pocketllm.config import FULL_ATTENTION_INTERVAL
from pocketllm.device_kind import resolve_kind
from pocketllm.errors import UsageError
from pocketllm.model_args import check_out_path, parse_dtype


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", type=absolute_path, help="HF checkpoint directory (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=positive_int, help="the preset's first N layers")
    p.add_argument("--random-weights", action="store_true", help="no checkpoint: each engine's own random weights at the preset's shapes")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"), help="cpu, cuda or npu (default cpu)")
    p.add_argument("--lengths", type=int_list(1), default="512,2048")
    p.add_argument("--decode-tokens", type=positive_int, default=64)
    p.add_argument("--reps", type=even_reps, default=4, help="reps per engine, even so each runs first equally often (default 4)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument(
        "--kernel-profile", action="store_true",
        help="after the reps, each engine's prefill at the longest length and its decode steps under torch.profiler: "
        "its kernels (CUDA) or torch ops (CPU) by time, side by side",
    )
    p.add_argument("--json", help="write every rep and the summary here")
    p.add_argument(
        "--warm-up-only", action="store_true",
        help="load and run the warm-up at every length, untimed, then stop: on a device it leaves the kernels a timed run "
        "compiles in Triton's on-disk cache (benchmarks/device_check.py warms each engine's shapes side by side this way)",
    )
    p.add_argument("--engine", choices=("both", "pocketllm", "transformers"), default="both", help="--warm-up-only: which engine (default both)")
    args = p.parse_args(argv)
    if args.engine != "both" and not args.warm_up_only:
        p.error("--engine picks one engine for --warm-up-only; a timed run sets the two side by side")
    if args.ckpt is not None and args.random_weights:
        p.error("--random-weights runs without a checkpoint: give --ckpt or --random-weights, not both")
    return args


class HFRunner:
    name = "transformers"

    def __init__(self, ckpt: str | None, dtype: torch.dtype, device: str = "cpu", cfg=None):
        """From the checkpoint, or (ckpt None) random weights at `cfg`'s shapes drawn on the device."""
        self.device = torch.device(device)
        # fla's kernels take device tensors only: on a CPU its torch forms, fla installed or not.
        transformers_model.modeling(fla=self.device.type != "cpu")
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        self.sync = device_sync(self.device)
        if ckpt is not None:
            self.model = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=dtype).eval().to(self.device)
        else:
            with torch.device(self.device):
                self.model = Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**cfg.to_hf_dict()), dtype=dtype).eval()
        # The forward's cache argument: `cache` in recent releases, `past_key_values` before (5.17
        # among them). The other name would go into **kwargs unread, and each step would start
        # from an empty cache: a decode of one token with no context, timed as a decode.
        self.vocab_size = self.model.config.vocab_size
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _ids(self, ids) -> torch.Tensor:
        return torch.tensor([ids], device=self.device)

    @torch.no_grad()
    def prefill(self, ids: list[int], measure=None):
        """Seconds of one prefill of ids; with `measure`, what measure(run the prefill) returns."""
        x = self._ids(ids)

        def run():
            self.model(x, use_cache=True, logits_to_keep=1)

        return (measure or self._seconds)(run)

    @torch.no_grad()
    def decode(self, ids: list[int], n: int, measure=None):
        """Seconds of n greedy decode steps after a prefill of ids, and the tokens; with `measure`,
        what measure(run the steps) returns in place of the seconds."""
        out = self.model(self._ids(ids), use_cache=True, logits_to_keep=1)
        tokens = [int(torch.argmax(out.logits[0, -1]))]
        cache = out.cache if hasattr(out, "cache") else out.past_key_values

        def steps():
            nonlocal cache
            for _ in range(n):
                out = self.model(self._ids([tokens[-1]]), **{self.cache_arg: cache}, use_cache=True)
                cache = out.cache if hasattr(out, "cache") else out.past_key_values
                tokens.append(int(torch.argmax(out.logits[0, -1])))

        result = (measure or self._seconds)(steps)
        if cache.get_seq_length() != len(ids) + n:
            raise RuntimeError(f"transformers' cache holds {cache.get_seq_length()} positions after a prompt of {len(ids)} and {n} steps "
                               f"(passed as {self.cache_arg!r}): its steps did not go on from it")
        return result, tokens

    def _seconds(self, fn) -> float:
        """Seconds of fn(), device-synchronised at both ends."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def kernel_profiles(runners, prompt: list[int], decode_prompt: list[int], steps: int, device_type: str) -> None:
    """Each engine's prefill of `prompt` and its `steps` decode steps once more under
    torch.profiler, a table each (docs/profile.md, --kernel-profile): where each engine's device
    time goes, side by side. A profile that fails is one line, not the end of the figures."""
    from pocketllm.profiling import kernel_profile

    for r in runners:
        try:
            measure = lambda fn: kernel_profile.profile(fn, device_type, r.sync)  # noqa: E731
            prefill = kernel_profile.table(f"{r.name}, prefill of {len(prompt)} tokens", *r.prefill(prompt, measure=measure))
            (wall, events), _ = r.decode(decode_prompt, steps, measure=measure)
            decode = kernel_profile.table(f"{r.name}, {steps} decode steps", wall, events)
        except Exception as e:  # noqa: BLE001  (the figures above stand without it)
            print(f"kernel profile of {r.name}: failed: {type(e).__name__}: {e}")
            continue
        for t in (prefill, decode):
            print("\n".join(kernel_profile.describe(t, device_type)))


def make_runners(args, dtype: torch.dtype) -> list:
    """The engines --engine names, pocketllm first: from the checkpoint, or with --random-weights
    each its own at the preset's shapes (cut to --layers, as pocketllm plans them)."""
    both = args.engine == "both"
    if args.random_weights:
        cfg = one_rank_plan(None, dtype, device=args.device, preset=args.preset, layers=args.layers).cfg
        pocket = lambda: PocketRunner(None, dtype, device=args.device, preset=args.preset, layers=args.layers)  # noqa: E731
        hf = lambda: HFRunner(None, dtype, args.device, cfg)  # noqa: E731
    else:
        ckpt = checkpoint_dir(args)
        pocket = lambda: PocketRunner(ckpt, dtype, device=args.device)  # noqa: E731
        hf = lambda: HFRunner(ckpt, dtype, args.device)  # noqa: E731
    return ([pocket()] if both or args.engine == "pocketllm" else []) + ([hf()] if both or args.engine == "transformers" else [])


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    # Every input is checked before the first model loads: a typo must not cost a run.
    resolve_kind(args.device)  # one line where torch sees no such device
    dtype = parse_dtype(args.dtype)
    check_out_path(args.json, "--json", args.ckpt)
    if args.random_weights and args.layers is not None and args.layers < FULL_ATTENTION_INTERVAL:
        # transformers' Qwen3.5 builds its attention mask from a full-attention layer's cache.
        raise UsageError(f"--layers {args.layers} holds no full-attention layer (every {FULL_ATTENTION_INTERVAL}th is one), "
                         f"which transformers' model needs: give --layers {FULL_ATTENTION_INTERVAL} or more")
    if not args.random_weights and args.layers is not None and args.ckpt is None:
        raise UsageError("--layers cuts a preset for --random-weights; for a checkpoint, write one with make-checkpoint --layers")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    lengths = args.lengths
    from pocketllm.inputs import bench_ids

    runners = make_runners(args, dtype)
    vocab = runners[0].vocab_size
    prompts = {n: bench_ids(n, vocab) for n in lengths}
    decode_prompt = bench_ids(32, vocab)
    # Warm-up at every timed length: a first pass at a shape pays for per-shape setup.
    for r in runners:
        for n in lengths:
            r.prefill(prompts[n])
        r.decode(decode_prompt, 2)
    if args.warm_up_only:
        print(f"warmed up: {', '.join(r.name for r in runners)} at {','.join(map(str, lengths))} tokens and 2 decode steps, untimed")
        return 0
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

    print(machine())
    print(f"device={args.device} threads={args.threads} dtype={args.dtype} reps={args.reps} (median, min..max)")
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
    model = runners[0].engine.model
    weight_bytes = limits.decode_weight_bytes(model)
    rates = limits.measure(torch.device(args.device), dtype, runners[0].sync)
    limit = rates.memory_gbps * 1e9 / weight_bytes
    summary["decode_streaming_limit_tok_s"] = round(limit, 1)
    summary["decode_share_of_memory_limit"] = round(statistics.median(a) / limit, 3)
    summary["transformers_decode_share_of_memory_limit"] = round(statistics.median(b) / limit, 3)
    print(
        f"decode weight bytes/step={weight_bytes / 2**20:.1f} MiB  memory rate={rates.memory_gbps:.1f} GB/s ({rates.memory_how})  "
        f"streaming limit={limit:.1f} tok/s  pocketllm at {100 * statistics.median(a) / limit:.0f}% of it, transformers at {100 * statistics.median(b) / limit:.0f}%"
    )
    for n in lengths:
        best = limits.prefill_gemm_flops(model, n) / (rates.matmul_tflops * 1e12)
        summary[f"prefill_{n}_share_of_matmul_limit"] = round(statistics.median(prefill[("pocketllm", n)]) * best / n, 3)
        print(f"prefill @{n}: GEMMs {limits.prefill_gemm_flops(model, n) / 1e12:.3g} TFLOP at {rates.matmul_tflops:.1f} TFLOP/s ({rates.matmul_how}): "
              f"pocketllm at {100 * summary[f'prefill_{n}_share_of_matmul_limit']:.0f}% of that limit, transformers at "
              f"{100 * statistics.median(prefill[('transformers', n)]) * best / n:.0f}%")
    if args.kernel_profile:
        kernel_profiles(runners, prompts[max(lengths)], decode_prompt, args.decode_tokens, torch.device(args.device).type)

    def finish() -> int:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"prefill_tok_s": {f"{k[0]}@{k[1]}": v for k, v in prefill.items()}, "decode_tok_s": decode, "summary": summary}, f, indent=2)
        print(json.dumps(summary))
        return 0

    if args.random_weights:
        print("greedy tokens: not compared (each engine's own random weights)")
        return finish()
    if args.device != "cpu":
        same = sum(1 for x, y in zip(tokens["pocketllm"], tokens["transformers"]) if x == y)
        print(f"greedy tokens: {same}/{len(tokens['pocketllm'])} equal")
        summary["greedy_tokens_equal"] = same == len(tokens["pocketllm"])
        return finish()
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
    return finish()


if __name__ == "__main__":
    sys.exit(main())

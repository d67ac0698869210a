"""`pocketllm bench`: the seed's resident bench. Load once, warm up, then one timed prefill of the
prompt and one timed decode of --max-new-tokens; rank 0 prints the result line."""

from __future__ import annotations

import json
import time

import torch

from pocketllm.commands.ranked import cpus_per_rank, peak_rss_mib_per_rank, per_rank, run_ranked, run_settings
from pocketllm.distributed.state import tp
from pocketllm.errors import UsageError
from pocketllm.inputs import bench_ids, check_ids, prompt_ids
from pocketllm.model_args import add_model_args, check_out_path

RESULT_FIELDS = ("prefill_seconds", "prefill_tokens", "prefill_tokens_per_s", "decode_seconds", "decode_tokens", "decode_tokens_per_s")


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, default=512, help="length of the deterministic prompt (default 512)")
    p.add_argument("--token-ids", help="use these ids as the prompt instead")
    p.add_argument("--token-ids-file", help="read the prompt ids from this file instead")
    p.add_argument("--max-new-tokens", type=int, default=32, help="timed decode steps (default 32)")
    add_warmup_arg(p)
    p.add_argument("--json", help="also write the result and the run's settings to this file")


def _prepare(args, plan):
    ids = prompt_ids(args, plan.cfg) or check_ids(bench_ids(args.prompt_tokens, plan.cfg.vocab_size), plan.cfg, args.max_new_tokens)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 for a bench, got {args.max_new_tokens}")
    check_warmup_tokens(args.warmup_tokens)
    check_out_path(args.json, "--json")
    return ids


def timed_prefill(engine, ids: list[int], sync, room: int = 0) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of `ids` from a fresh sequence with `room` positions left after it,
    device-synchronised at both ends, and its logits."""
    engine.start_sequence(len(ids) + room)
    prompt = torch.tensor(ids, dtype=torch.long)
    sync()
    t0 = time.perf_counter()
    logits = engine.prefill(prompt)
    sync()
    return time.perf_counter() - t0, logits


def timed_greedy_decode(engine, token: int, steps: int, sync) -> tuple[float, list[int]]:
    """Seconds of `steps` greedy decode steps fed from `token`, device-synchronised at both ends,
    and the tokens they chose."""
    chosen = []
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(torch.argmax(engine.decode(token)))
        chosen.append(token)
    sync()
    return time.perf_counter() - t0, chosen


def timed_prefill_decode(engine, ids: list[int], new_tokens: int, sync) -> dict:
    """One timed prefill and `new_tokens` timed greedy decode steps from a fresh sequence."""
    prefill_s, logits = timed_prefill(engine, ids, sync, room=new_tokens)
    collectives = sum(engine.last_collectives.values())
    slices = engine.last_slices
    decode_s, _ = timed_greedy_decode(engine, int(torch.argmax(logits)), new_tokens, sync)
    return {
        "prefill_seconds": prefill_s,
        "prefill_tokens": len(ids),
        "prefill_tokens_per_s": len(ids) / prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens": new_tokens,
        "decode_tokens_per_s": new_tokens / decode_s,
        "slices": slices,
        "collectives": collectives,
    }


def add_warmup_arg(p) -> None:
    p.add_argument(
        "--warmup-tokens", type=int, help="cap each warm-up prefill at N tokens (default: none, so each runs the timed length and slice count)"
    )


def check_warmup_tokens(warmup_tokens: int | None) -> None:
    """warm_up's --warmup-tokens, checked before any rank starts."""
    if warmup_tokens is not None and warmup_tokens < 1:
        raise UsageError(f"--warmup-tokens must be >= 1, got {warmup_tokens}")


def warm_up(engine, ids: list[int], rows: list[int], sync, warmup_tokens: int | None = None) -> None:
    """One untimed prefill of ids[:n] for each timed row count n, under the engine's current slice
    policy, so each warms the slice count its timed pass runs, then two decode steps. The first
    pass at a shape pays for what a device sets up per shape (GEMM heuristics, the collective's
    protocol, Triton autotuning, Ascend operators compiled per shape); warmed at another shape,
    that cost would land in the timed prefill. `warmup_tokens` caps each warm-up prefill."""
    lengths = sorted({max(1, min(n, len(ids), warmup_tokens or n)) for n in rows})
    with engine.tagged(warmup=True):
        for n in lengths:
            timed_prefill_decode(engine, ids[:n], 2, sync)


def format_result(r: dict) -> str:
    parts = [
        f"prefill_seconds={r['prefill_seconds']:.4f}",
        f"prefill_tokens={r['prefill_tokens']}",
        f"prefill_tokens_per_s={r['prefill_tokens_per_s']:.1f}",
        f"decode_seconds={r['decode_seconds']:.4f}",
        f"decode_tokens={r['decode_tokens']}",
        f"decode_tokens_per_s={r['decode_tokens_per_s']:.2f}",
        f"slices={r['slices']}",
        f"collectives={r['collectives']}",
    ]
    return " ".join(parts)


def _work(args, plan, ids, engine, device) -> int:
    warm_up(engine, ids, [len(ids)], device.synchronize, args.warmup_tokens)
    with engine.tagged(timed=True):
        result = timed_prefill_decode(engine, ids, args.max_new_tokens, device.synchronize)
    rss = peak_rss_mib_per_rank()
    load_peak = per_rank(engine.load_peak_mib)
    weights = per_rank(engine.loaded_bytes / 2**20)
    cpus = cpus_per_rank()
    if tp().rank == 0:
        print(format_result(result), flush=True)
        if args.json:
            settings = {
                **run_settings(args, plan, device),
                "policy": plan.policy.policy.describe(),
                "gdn_kernel": engine.gdn_kernel.name if engine.gdn_kernel else None,
                "peak_rss_mib_per_rank": rss,
                "weights_mib_per_rank": weights,
                "load_peak_rss_over_baseline_mib_per_rank": load_peak,
                "cpus_per_rank": cpus,
                "gemv": engine.gemv.to_json(),
                "decode_ops": engine.model.decode_ops.describe(),
            }
            with open(args.json, "w") as f:
                json.dump({**result, "settings": settings}, f, indent=2)
    return 0


def run(args, argv) -> int:
    return run_ranked(args, argv, _prepare, _work)

"""The timed units every measuring command is built from: a device-synchronised prefill, a run of
greedy decode steps, the two together as the resident bench times them, and the warm-up before
them. Commands and benchmarks share these, so every figure times the same thing."""

from __future__ import annotations

import time

import torch


def timed_prefill(engine, ids: list[int], sync, room: int = 0) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of `ids` from a fresh sequence (the engine's slot 0) with `room`
    positions left after it, device-synchronised at both ends, and its last row's logits [V]."""
    engine.reserve_slots(1, len(ids) + room)
    prompt = torch.tensor(ids, dtype=torch.long)
    sync()
    t0 = time.perf_counter()
    logits = engine.run_packed([(0, 0, prompt)])[0]
    sync()
    return time.perf_counter() - t0, logits


def timed_greedy_decode(engine, token: int, pos: int, steps: int, sync, slot: int = 0) -> tuple[float, list[int]]:
    """Seconds of `steps` greedy decode steps of `slot`'s sequence fed from `token` at position
    `pos`, device-synchronised at both ends, and the tokens they chose."""
    chosen = []
    sync()
    t0 = time.perf_counter()
    for step in range(steps):
        token = engine.greedy_row(slot, pos + step, token)
        chosen.append(token)
    sync()
    return time.perf_counter() - t0, chosen


def timed_prefill_decode(engine, ids: list[int], new_tokens: int, sync) -> dict:
    """One timed prefill and `new_tokens` timed greedy decode steps from a fresh sequence."""
    prefill_s, logits = timed_prefill(engine, ids, sync, room=new_tokens)
    collectives = sum(engine.last_collectives.values())
    slices = engine.last_slices
    decode_s, _ = timed_greedy_decode(engine, int(torch.argmax(logits)), len(ids), new_tokens, sync)
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


def timed_batch(engine, prompts: list[list[int]], new_tokens: int, sync) -> dict:
    """One timed prefill of every prompt packed into one pass, from fresh sequences, then
    `new_tokens` timed greedy decode steps of them all, one row per sequence per pass."""
    batch, length = len(prompts), len(prompts[0])
    engine.reserve_slots(batch, length + new_tokens)
    spans = [(slot, 0, torch.tensor(ids, dtype=torch.long)) for slot, ids in enumerate(prompts)]
    sync()
    t0 = time.perf_counter()
    logits = engine.run_packed(spans)
    sync()
    prefill_s = time.perf_counter() - t0
    collectives = sum(engine.last_collectives.values())
    slices = engine.last_slices
    tokens = torch.argmax(logits, dim=-1)
    sync()
    t0 = time.perf_counter()
    for step in range(new_tokens):
        logits = engine.run_packed([(slot, length + step, tokens[slot : slot + 1]) for slot in range(batch)])
        tokens = torch.argmax(logits, dim=-1)
    sync()
    decode_s = time.perf_counter() - t0
    return {
        "batch": batch,
        "prefill_seconds": prefill_s,
        "prefill_tokens": batch * length,
        "prefill_tokens_per_s": batch * length / prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens": batch * new_tokens,
        "decode_tokens_per_s": batch * new_tokens / decode_s,
        "decode_tokens_per_s_per_sequence": new_tokens / decode_s,
        "slices": slices,
        "collectives": collectives,
    }


def warm_up_batch(engine, prompts: list[list[int]], sync, warmup_tokens: int | None = None) -> None:
    """timed_batch's warm-up: one untimed batch at the timed shape (each prompt cut to
    `warmup_tokens` when given) with two decode steps."""
    n = min(len(prompts[0]), warmup_tokens or len(prompts[0]))
    with engine.tagged(warmup=True):
        timed_batch(engine, [p[:n] for p in prompts], 2, sync)

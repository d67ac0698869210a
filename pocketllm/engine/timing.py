"""The timed units every measuring command is built from: a device-synchronised prefill, a run of
greedy decode steps, the two together as the resident bench times them, and the warm-up before
them. Each runs fresh sequences through the generation loop users run (the Scheduler's step, in
lockstep on every rank), so every figure times what generate and serve run."""

from __future__ import annotations

import time

from pocketllm.engine.scheduler import Scheduler


class TimedRun:
    """Fresh greedy sequences of `prompts`, each with room for `new_tokens` tokens after the first:
    `prefill()` reads every prompt in one pass (which chooses each sequence's first token), then
    each `decode(steps)` runs that many decode steps of them all (one row per sequence a pass)."""

    def __init__(self, engine, prompts: list[list[int]], new_tokens: int, sync):
        self.engine, self.sync = engine, sync
        longest = max(len(p) for p in prompts)
        self.sched = Scheduler(engine, len(prompts), longest + new_tokens + 1, prefill_budget=sum(len(p) for p in prompts), lockstep=True)
        self.requests = [self.sched.submit(p, new_tokens + 1) for p in prompts]
        self.collectives, self.slices = 0, 1
        self.decode_path = ""

    def prefill(self) -> float:
        """Seconds of the prefill pass, device-synchronised at both ends."""
        self.sync()
        t0 = time.perf_counter()
        self.sched.step()
        self.sync()
        seconds = time.perf_counter() - t0
        if any(len(r.output) != 1 for r in self.requests):
            raise RuntimeError("a timed prefill did not read every prompt in one pass")
        self.collectives, self.slices = sum(self.engine.last_collectives.values()), self.engine.last_slices
        return seconds

    def decode(self, steps: int) -> float:
        """Seconds of `steps` decode steps, device-synchronised at both ends; what ran their rows
        is then `decode_path`."""
        direct = self.engine.direct_steps
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.sched.step()
        self.sync()
        seconds = time.perf_counter() - t0
        # Decode rows the step backend ran (a backend that runs several sequences' rows at once).
        self.decode_path = _decode_path(self.engine.direct_steps - direct, steps * len(self.requests))
        return seconds

    @property
    def tokens(self) -> list[list[int]]:
        """Each sequence's tokens so far: the prefill's, then one per decode step."""
        return [r.output for r in self.requests]

    def close(self) -> None:
        self.sched.close()


def timed_prefill(engine, ids: list[int], sync, room: int = 0) -> tuple[float, TimedRun]:
    """Seconds of one prefill of `ids` from a fresh sequence with `room` decode steps left after
    it, and the run, to go on decoding (TimedRun.decode)."""
    run = TimedRun(engine, [ids], room, sync)
    return run.prefill(), run


def timed_prefill_decode(engine, ids: list[int], new_tokens: int, sync) -> dict:
    """One timed prefill and `new_tokens` timed greedy decode steps from a fresh sequence."""
    prefill_s, run = timed_prefill(engine, ids, sync, room=new_tokens)
    decode_s = run.decode(new_tokens)
    run.close()
    return {
        "prefill_seconds": prefill_s,
        "prefill_tokens": len(ids),
        "prefill_tokens_per_s": len(ids) / prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens": new_tokens,
        "decode_tokens_per_s": new_tokens / decode_s,
        "slices": run.slices,
        "collectives": run.collectives,
        "decode_step": run.decode_path,
    }


def _decode_path(direct: int, steps: int) -> str:
    """What ran the timed decode steps: the decode-step backend for every one, or the layers."""
    return "direct" if direct == steps else "layers" if direct == 0 else f"direct-{direct}-of-{steps}"


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
    run = TimedRun(engine, prompts, new_tokens, sync)
    prefill_s = run.prefill()
    decode_s = run.decode(new_tokens)
    run.close()
    return {
        "batch": batch,
        "prefill_seconds": prefill_s,
        "prefill_tokens": batch * length,
        "prefill_tokens_per_s": batch * length / prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens": batch * new_tokens,
        "decode_tokens_per_s": batch * new_tokens / decode_s,
        "decode_tokens_per_s_per_sequence": new_tokens / decode_s,
        "slices": run.slices,
        "collectives": run.collectives,
        "decode_step": run.decode_path,
    }


def warm_up_batch(engine, prompts: list[list[int]], sync, warmup_tokens: int | None = None) -> None:
    """timed_batch's warm-up: one untimed batch at the timed shape (each prompt cut to
    `warmup_tokens` when given) with two decode steps."""
    n = min(len(prompts[0]), warmup_tokens or len(prompts[0]))
    with engine.tagged(warmup=True):
        timed_batch(engine, [p[:n] for p in prompts], 2, sync)

"""Token generation through the generation loop every way of producing tokens shares (the
Scheduler's step): one prompt run in lockstep on every rank (each rank feeds the same token to the
next step, a sampled token being drawn on rank 0 and broadcast, a greedy one the argmax of logits
every rank holds alike), or several as one continuously batched run that rank 0 schedules and the
other ranks follow."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from pocketllm.distributed.state import tp
from pocketllm.engine import budgets
from pocketllm.engine.pass_plan import follow
from pocketllm.engine.runner import Engine
from pocketllm.engine.sampling import SamplingParams
from pocketllm.engine.scheduler import Scheduler
from pocketllm.engine.slots import pool_blocks
from pocketllm.inputs import prompt_problem


def generate(
    engine: Engine,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: tuple[int, ...] = (),
    prompt_logits: Callable[[torch.Tensor], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Prefill the prompt, then decode up to max_new_tokens, stopping after an eos id.
    prompt_logits, when given, receives every prompt position's logits [T, V] from that same
    prefill; their last row is the one-row head's, so the tokens are those of a run without it.
    on_token, when given, receives each token as soon as it is chosen, before the step that feeds
    it (on every rank)."""
    # The prompt is read even when no token is asked for (its logits may be); the token its
    # last row chooses is then not reported.
    problem = prompt_problem(prompt, engine.cfg.vocab_size)
    if problem:
        raise ValueError(problem)  # before the scheduler's sizes, which a bad prompt would make
    asked = max(max_new_tokens, 0)
    sched = Scheduler(engine, 1, len(prompt) + max(asked, 1), prefill_budget=min(len(prompt), budgets.LONGEST_PASS_ROWS), lockstep=True)
    rows: list[torch.Tensor] = []
    try:
        # Each pass's rows to the host as they come: a device would hold them all twice (kept, then joined).
        req = sched.submit(prompt, max(asked, 1), sampling, eos_ids, prompt_logits=(lambda start, logits: rows.append(logits.cpu())) if prompt_logits else None)
        while sched.has_work:
            for _, token in sched.step():
                if token is not None and on_token is not None and asked:
                    on_token(token)
    finally:
        sched.close()
    if prompt_logits is not None:
        prompt_logits(torch.cat(rows))
    return req.output[:asked]


def generate_batch(engine, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(), eos_ids=(), max_running: int | None = None) -> list[list[int]]:
    """Every prompt's continuation, run as one batch (at most max_running at once); on ranks
    other than 0 it follows rank 0's passes and returns []. Sampled, prompt i draws with seed
    sampling.seed + i: its own stream (the same prompt twice is two samples), and the tokens it
    gets alone with that seed."""
    if not prompts:
        raise ValueError("no prompts: give at least one")
    max_running = min(max_running or len(prompts), len(prompts))
    max_len = max(len(p) for p in prompts) + max_new_tokens
    # The pool: what max_running sequences of max_len fill, or the default budget if smaller.
    kv_blocks = pool_blocks(engine)
    if tp().rank != 0:
        follow(engine, max_running, max_len, kv_blocks=kv_blocks)
        return []
    sched = Scheduler(engine, max_running, max_len, kv_blocks=kv_blocks)
    try:
        requests = [sched.submit(p, max_new_tokens, replace(sampling, seed=(sampling.seed + i) % 2**64), eos_ids) for i, p in enumerate(prompts)]
        while sched.has_work:
            sched.step()
    except BaseException:
        sched.close(tell_ranks=False)
        raise
    sched.close()
    return [r.output for r in requests]

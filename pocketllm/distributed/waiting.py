"""How a rank waits for a collective it has started.

On gloo (CPU ranks) the rank polls the work handle, yielding its core between polls, instead of
blocking in `work.wait()`. A blocked rank lets its core go idle, and waking an idle core costs
far more than the collective itself on a virtual machine: blocked, a tenth of the small gloo
all-reduces between two pinned ranks took over ten times the median (docs/measuring.md, figures
behind the code's choices, and the end-to-end effect). Polling keeps the
core awake, while sched_yield still lets gloo's own threads, pinned to the same core, run.
NCCL and HCCL keep the plain wait: their work handles order device streams and return at once (the
host tensors such a run broadcasts, rank 0's pass plans, go over the group's gloo half, whose plain
wait blocks on the host).
POCKETLLM_POLL_COLLECTIVES=0 turns polling off (benchmarks/switch_ab.py measures both).
"""

from __future__ import annotations

import os
import time

from pocketllm.switches import env_switch

ENV_POLL = "POCKETLLM_POLL_COLLECTIVES"

_poll = False


def polls_on(backend: str | None, env=os.environ) -> bool:
    """Whether ranks of `backend` poll (None: a rank with no peer, which waits on no collective);
    a bad ENV_POLL value is a usage error."""
    on = env_switch(env, ENV_POLL, default=True)
    return on and backend == "gloo" and hasattr(os, "sched_yield")


def configure(backend: str | None, env=os.environ) -> None:
    """Set how this process waits, once its backend is known."""
    global _poll
    _poll = polls_on(backend, env)


def polling() -> bool:
    return _poll


def wait(work) -> None:
    """Wait for `work` to finish and raise its error if it failed. A failed or timed-out gloo
    collective completes with its error, so polling ends exactly when the plain wait would."""
    if _poll:
        while not work.is_completed():
            os.sched_yield()
    work.wait()


def wait_idle(work, spin_seconds: float = 0.05) -> None:
    """Wait for `work` that may be long in coming (the next request of an idle server): poll as
    wait() does for `spin_seconds`, so a pass that follows at once is met awake, then block, so
    an idle rank does not hold its core."""
    if _poll:
        end = time.monotonic() + spin_seconds
        while not work.is_completed() and time.monotonic() < end:
            os.sched_yield()
    work.wait()

"""Fault injection, for tests only: make one rank fail on purpose, so the tests can check that a
dead or hung rank ends the whole run with a clear error, in bounded time, leaving no process.

    POCKETLLM_FAULT=rank=R,at=load|prefill|decode,kind=exit|kill|hang|raise

`at=load` fires before the rank loads its weights; `prefill` / `decode` before the first pass of
that kind (warm-up passes do not count). `exit` leaves with FAULT_EXIT_CODE, `kill` sends the rank
SIGKILL, `hang` sleeps forever (peers then time out after --dist-timeout), `raise` raises a
RuntimeError. Not a user feature: nothing outside the tests should set it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from pocketllm.errors import UsageError
from pocketllm.switches import env_value

ENV_FAULT = "POCKETLLM_FAULT"
POINTS = ("load", "prefill", "decode")
KINDS = ("exit", "kill", "hang", "raise")
FAULT_EXIT_CODE = 3
_FIELDS = ("rank", "at", "kind")


@dataclass(frozen=True)
class Fault:
    rank: int
    at: str
    kind: str

    def fire(self) -> None:
        what = f"rank {self.rank} at {self.at}: {self.kind}"
        print(f"pocketllm: injected fault ({ENV_FAULT}) {what}", file=sys.stderr, flush=True)
        if self.kind == "exit":
            # Leave as a crash would: no unwinding, no cleanup.
            os._exit(FAULT_EXIT_CODE)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault ({ENV_FAULT}) {what}")


def parse_fault(spec: str, world: int) -> Fault:
    fields = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in _FIELDS:
            raise UsageError(f"{ENV_FAULT}={spec!r}: expected rank=R,at=load|prefill|decode,kind=exit|kill|hang|raise")
        fields[key] = value.strip()
    missing = [k for k in _FIELDS if k not in fields]
    if missing:
        raise UsageError(f"{ENV_FAULT}={spec!r}: missing {', '.join(missing)}")
    try:
        rank = int(fields["rank"])
    except ValueError:
        raise UsageError(f"{ENV_FAULT}: rank {fields['rank']!r} is not an integer") from None
    if not 0 <= rank < world:
        raise UsageError(f"{ENV_FAULT}: rank {rank} is outside 0..{world - 1}")
    if fields["at"] not in POINTS:
        raise UsageError(f"{ENV_FAULT}: at={fields['at']!r} is not one of {', '.join(POINTS)}")
    if fields["kind"] not in KINDS:
        raise UsageError(f"{ENV_FAULT}: kind={fields['kind']!r} is not one of {', '.join(KINDS)}")
    return Fault(rank, fields["at"], fields["kind"])


class FaultHook:
    """An engine pass hook that fires this rank's injected fault, if it has one."""

    # It fires at a pass's kind and watches no layer: a decode row may go straight to the step.
    watches_layers = False

    def __init__(self, fault: Fault | None, rank: int):
        self.fault = fault if fault is not None and fault.rank == rank else None

    def at(self, point: str) -> None:
        if self.fault is not None and self.fault.at == point:
            self.fault.fire()

    def before_pass(self, info) -> None:
        self.at(info.kind)

    def after_pass(self, info) -> None:
        pass


def fault_from_env(world: int, env=os.environ) -> Fault | None:
    """The injected fault, checked against the world size; None when none is asked for."""
    spec = env_value(env, ENV_FAULT)
    return parse_fault(spec, world) if spec else None

"""--collective, or POCKETLLM_COLLECTIVE, checked: which all-reduce a run asks for
(pocketllm/distributed/collective.py sets it up on the ranks). Torch-free: the launcher checks it
before it starts a rank."""

from __future__ import annotations

import os

from pocketllm import compiled
from pocketllm.distributed.shm import build as shm_build
from pocketllm.errors import UsageError
from pocketllm.switches import env_value

ENV_COLLECTIVE = "POCKETLLM_COLLECTIVE"
CHOICES = ("auto", "shm", "gloo")


def resolve_choice(flag: str | None, env=os.environ) -> tuple[str, str]:
    """--collective, else POCKETLLM_COLLECTIVE, else auto, and how it was asked (`--collective X`,
    `POCKETLLM_COLLECTIVE=X`, "" for the default), for the lines that name it; anything else is a
    usage error."""
    if flag is not None:
        if flag not in CHOICES:
            raise UsageError(f"--collective {flag!r} is not one of {', '.join(CHOICES)}")
        return flag, f"--collective {flag}"
    value = env_value(env, ENV_COLLECTIVE).strip()
    if not value:
        return "auto", ""
    if value not in CHOICES:
        raise UsageError(f"{ENV_COLLECTIVE}={value!r} is not one of {', '.join(CHOICES)}")
    return value, f"{ENV_COLLECTIVE}={value}"


def check_choice(choice: str, backend: str, asked: str = "") -> None:
    """What rules shm out whatever the ranks find, refused wherever it is known (before a launcher
    starts its ranks, and on each rank): shm sums between CPU ranks (gloo), and its helper is built
    with a C compiler. Its other conditions (one host, a segment every rank maps) are the ranks'
    to find."""
    if choice != "shm":
        return
    asked = asked or "--collective shm"
    if backend != "gloo":
        raise UsageError(f"{asked} needs CPU ranks (gloo); this run's backend is {backend}")
    why = compiled.no_compiler(shm_build.SOURCE)
    if why:
        raise UsageError(f"{asked}: {why}")

"""--collective, or POCKETLLM_COLLECTIVE, checked: which all-reduce a run asks for
(pocketllm/distributed/collective.py sets it up on the ranks). Torch-free: the launcher checks it
before it starts a rank."""

from __future__ import annotations

import os

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.switches import env_value

ENV_COLLECTIVE = "POCKETLLM_COLLECTIVE"
CHOICES = ("auto", "shm", "gloo")
# The shared-memory all-reduce's source (distributed/shm/allreduce.c), as the build names it.
SHM_SOURCE = "allreduce.c"


def resolve_choice(flag: str | None, env=os.environ) -> str:
    """--collective, else POCKETLLM_COLLECTIVE, else auto; anything else is a usage error."""
    if flag is not None:
        if flag not in CHOICES:
            raise UsageError(f"--collective {flag!r} is not one of {', '.join(CHOICES)}")
        return flag
    value = env_value(env, ENV_COLLECTIVE).strip()
    if not value:
        return "auto"
    if value not in CHOICES:
        raise UsageError(f"{ENV_COLLECTIVE}={value!r} is not one of {', '.join(CHOICES)}")
    return value


def check_choice(choice: str, backend: str) -> None:
    """What the ranks would refuse about a choice, refused before any starts: shm runs between CPU
    ranks (gloo) and is built with a C compiler, without which it can never be (a build is keyed
    on the compiler, so no cached one serves). Its other conditions (one host, a segment every
    rank maps) are the ranks' to find."""
    if choice != "shm" or backend != "gloo":
        if choice == "shm":
            raise UsageError(f"--collective shm needs CPU ranks (gloo); this run's backend is {backend}")
        return
    if compiled.compiler() is None:
        raise UsageError(f"--collective shm: no C compiler (cc, gcc or clang; or $CC) to build {SHM_SOURCE}")

"""--collective, or POCKETLLM_COLLECTIVE, checked: which all-reduce a run asks for
(pocketllm/distributed/collective.py sets it up on the ranks). Torch-free: the launcher checks it
before it starts a rank."""

from __future__ import annotations

import os

from pocketllm.errors import UsageError
from pocketllm.switches import env_value

ENV_COLLECTIVE = "POCKETLLM_COLLECTIVE"
CHOICES = ("auto", "shm", "gloo")


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

"""On/off settings read from the environment: 1/true/yes/on or 0/false/no/off, anything else a
usage error that names the variable."""

from __future__ import annotations

from pocketllm.errors import UsageError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(env, name: str, default: bool = False) -> bool:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise UsageError(f"{name}={env.get(name)!r} is not a switch: use 1 (on) or 0 (off)")

"""Settings read from the environment. Every variable is named POCKETLLM_*; two of the seed's
QWEN_* names are still read, as aliases, so scripts written for the seed keep working. On/off
settings take 1/true/yes/on or 0/false/no/off, anything else a usage error that names the
variable."""

from __future__ import annotations

from pocketllm.errors import UsageError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")

# The seed's names, read only when the POCKETLLM_* name is unset or empty: the new name wins.
ALIASES = {
    "POCKETLLM_COMM_OVERLAP_SLICES": "QWEN_COMM_OVERLAP_SLICES",
    "POCKETLLM_GDN_KERNEL": "QWEN_GDN_KERNEL",
}


def env_setting(env, name: str) -> tuple[str, str]:
    """(the variable the setting was read from, its value, "" when unset), so that an error can
    name the variable the user actually set."""
    value = env.get(name, "")
    alias = ALIASES.get(name)
    if not value.strip() and alias is not None and env.get(alias, "").strip():
        return alias, env[alias]
    return name, value


def env_switch(env, name: str, default: bool = False) -> bool:
    used, raw = env_setting(env, name)
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise UsageError(f"{used}={raw!r} is not a switch: use 1 (on) or 0 (off)")

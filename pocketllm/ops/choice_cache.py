"""The per-machine file where measured kernel choices are kept (under compiled.cache_dir()), so
the next load on the same machine only reads them. A choice's key names what it depends on (CPU,
torch version, dtype, threads, shape), so another machine or version measures its own."""

from __future__ import annotations

import json
import os

from pocketllm import compiled


def path(name: str) -> str:
    return str(compiled.cache_dir() / name)


def read(name: str) -> dict:
    try:
        with open(path(name)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write(name: str, entries: dict) -> None:
    """Merge `entries` into the file."""
    target = path(name)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        data = {**read(name), **entries}
        # Written beside and renamed over: ranks writing at once never leave a torn file.
        tmp = f"{target}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, target)
    except OSError:
        # A read-only home only means measuring again next time.
        pass

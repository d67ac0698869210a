"""Flag helpers that more than one command uses: value lists, payload sizes and the warm-up cap.
Kept apart from the commands (a command never imports another); torch-free, as everything a
launcher checks is."""

from __future__ import annotations

from pocketllm.errors import UsageError


def parse_positive_list(text: str, flag: str) -> list[int]:
    parts = [p.strip() for p in (text or "").split(",")]
    if not text or not any(parts):
        raise UsageError(f"{flag} is empty; give comma-separated positive integers")
    values = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise UsageError(f"{flag}: {p!r} is not an integer") from None
        if v < 1:
            raise UsageError(f"{flag}: {v} must be a positive integer")
        values.append(v)
    return values


def add_warmup_arg(p) -> None:
    p.add_argument(
        "--warmup-tokens", type=int, help="cap each warm-up prefill at N tokens (default: none, so each runs the timed length and slice count)"
    )


def check_warmup_tokens(warmup_tokens: int | None) -> None:
    """warm_up's --warmup-tokens, checked before any rank starts."""
    if warmup_tokens is not None and warmup_tokens < 1:
        raise UsageError(f"--warmup-tokens must be >= 1, got {warmup_tokens}")


SIZE_SUFFIXES = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str, flag: str) -> int:
    """'1K', '64M', '4096' -> bytes; K/M/G are powers of 1024, as nccl-tests reads them."""
    s = str(text).strip().upper()
    unit = s[-1] if s and s[-1] in SIZE_SUFFIXES else ""
    number = s[: len(s) - len(unit)] if unit else s
    try:
        value = int(number) * SIZE_SUFFIXES[unit]
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a size; give an integer with an optional K, M or G suffix") from None
    if value < 1:
        raise UsageError(f"{flag} must be at least 1 byte, got {text!r}")
    return value


def size_ladder(min_bytes: int, max_bytes: int, factor: int, elem_bytes: int) -> list[int]:
    """Payload sizes from min to max, each `factor` times the last, rounded to whole elements."""
    if factor < 2:
        raise UsageError(f"--factor must be an integer >= 2, got {factor}")
    if max_bytes < min_bytes:
        raise UsageError(f"--max-bytes {max_bytes} is below --min-bytes {min_bytes}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(max(elem_bytes, size // elem_bytes * elem_bytes))
        size *= factor
    return sorted(set(sizes))

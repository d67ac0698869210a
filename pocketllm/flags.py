"""Flag helpers that more than one command uses: value lists and the warm-up cap. Kept apart from
the commands (a command never imports another) and from model_args (these need no torch)."""

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

"""Prompt input: token ids from a flag or a file, or text through the checkpoint's tokenizer.json,
checked against the vocab and the position limit before any rank starts."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from pocketllm.config import ModelConfig
from pocketllm.errors import UsageError

# The seed's resident-bench prompt, repeated to the requested length.
BENCH_PATTERN = (100, 264, 4628, 286, 1879, 310, 278, 4221, 13, 576)


def parse_token_ids(text: str, where: str) -> list[int]:
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    ids = []
    for p in parts:
        try:
            ids.append(int(p))
        except ValueError:
            raise UsageError(f"{where}: {p!r} is not an integer token id (expected integers separated by commas or whitespace)") from None
    return ids


def read_token_ids_file(path: str) -> list[int]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--token-ids-file {path}: cannot read ({exc.strerror if isinstance(exc, OSError) else exc})") from None
    return parse_token_ids(text, f"--token-ids-file {path}")


def load_tokenizer(ckpt: str | None, flag: str = "--prompt", instead: str = "pass --token-ids instead"):
    """The checkpoint's tokenizer.json, parsed; a usage error naming `flag` when there is none."""
    if ckpt is None:
        raise UsageError(f"{flag} needs a checkpoint with tokenizer.json (--ckpt DIR), and presets have none; {instead}")
    path = Path(ckpt) / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"{flag} needs {path}, which does not exist; {instead}")
    return _read_tokenizer(str(path))


@functools.lru_cache(maxsize=4)
def _read_tokenizer(path: str):
    """Parsed once per process: rank 0 encodes the prompt and later decodes the output with it."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own exception type for any malformed file
        raise UsageError(f"{path} is not a readable tokenizer: {str(exc).splitlines()[0]}") from None


def bench_ids(n: int, vocab: int) -> list[int]:
    if n < 1:
        raise UsageError(f"--prompt-tokens must be >= 1, got {n}")
    return [BENCH_PATTERN[i % len(BENCH_PATTERN)] % vocab for i in range(n)]


def check_ids(ids: list[int], cfg: ModelConfig, max_new_tokens: int) -> list[int]:
    if not ids:
        raise UsageError("the prompt is empty: give at least one token")
    for i, t in enumerate(ids):
        if not 0 <= t < cfg.vocab_size:
            raise UsageError(f"token id {t} at position {i} is outside the vocab [0, {cfg.vocab_size})")
    if max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    total = len(ids) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise UsageError(
            f"prompt of {len(ids)} tokens plus {max_new_tokens} new tokens is {total}, "
            f"over max_position_embeddings={cfg.max_position_embeddings}"
        )
    return ids


def prompt_ids(args, cfg: ModelConfig) -> list[int]:
    """The prompt from --token-ids, --token-ids-file or --prompt (exactly one)."""
    given = [n for n in ("token_ids", "token_ids_file", "prompt") if getattr(args, n, None) is not None]
    if len(given) > 1:
        raise UsageError("give only one of --prompt, --token-ids, --token-ids-file")
    if args.token_ids is not None:
        ids = parse_token_ids(args.token_ids, "--token-ids")
    elif args.token_ids_file is not None:
        ids = read_token_ids_file(args.token_ids_file)
    elif getattr(args, "prompt", None) is not None:
        if not args.prompt:
            raise UsageError("the prompt is empty: give at least one token")
        ids = load_tokenizer(args.ckpt).encode(args.prompt).ids
    else:
        return []
    return check_ids(ids, cfg, args.max_new_tokens)

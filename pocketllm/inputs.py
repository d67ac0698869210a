"""Prompt input: token ids from a flag or a file, or text through the checkpoint's tokenizer.json,
checked against the vocab and the position limit before any rank starts."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from pocketllm.config import ModelConfig
from pocketllm.errors import UsageError, not_a_file

# The seed's resident-bench prompt, repeated to the requested length.
BENCH_PATTERN = (100, 264, 4628, 286, 1879, 310, 278, 4221, 13, 576)


def parse_token_ids(text: str, where: str) -> list[int]:
    # A comma with no id before or after it (1,,2 or 1,2,) is an id left out, not a separator.
    if re.search(r"(^|,)\s*(,|$)", text.strip()) and "," in text:
        raise UsageError(f"{where}: an id is missing between commas (expected integers separated by commas or whitespace)")
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
    why = not_a_file(path)
    if why:
        raise UsageError(f"{flag} needs {path}, which {why}; {instead}")
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


def prompt_problem(ids: list[int], vocab: int) -> str:
    """What makes `ids` no prompt for a model of `vocab` tokens ("" when nothing does)."""
    if not isinstance(ids, (list, tuple)):
        return f"the prompt must be a list of token ids (ints), got {type(ids).__name__}"
    if not ids:
        return "the prompt is empty: give at least one token"
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            return f"token id at position {i} of the prompt is {t!r}, not an int"
        if not 0 <= t < vocab:
            return f"token id {t} at position {i} is outside the vocab [0, {vocab})"
    return ""


def request_problem(ids: list[int], max_new_tokens: int, vocab: int, max_len: int) -> str:
    """What keeps a request of prompt `ids` and `max_new_tokens` new tokens from running in a
    sequence of at most `max_len` positions ("" when nothing does): the scheduler's check, which
    the HTTP side runs too so that a client hears a 400, not a refusal from the engine process."""
    problem = prompt_problem(ids, vocab)
    if problem:
        return problem
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        return f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}"
    if len(ids) + max_new_tokens > max_len:
        return (f"prompt of {len(ids)} tokens plus {max_new_tokens} new tokens is {len(ids) + max_new_tokens}, "
                f"over the {max_len} positions a sequence may hold")
    return ""


def check_ids(ids: list[int], cfg: ModelConfig, max_new_tokens: int, given_by: str = "") -> list[int]:
    """ids as a prompt of cfg's model, refused naming `given_by` (the flag, file or line it came
    from) where it cannot be one."""
    problem = prompt_problem(ids, cfg.vocab_size)
    if problem:
        raise UsageError(f"{given_by}: {problem}" if given_by else problem)
    check_length(len(ids), cfg, max_new_tokens)
    return ids


def checked_bench_ids(n: int, cfg: ModelConfig, max_new_tokens: int, sized_by: str = "--prompt-tokens") -> list[int]:
    """bench_ids(n) for cfg, its length checked before a list of n ids is made (the ids are the
    vocab's by construction, and bench_ids refuses n < 1); sized_by: the flag that gave n."""
    check_length(n, cfg, max_new_tokens, sized_by=sized_by)
    return bench_ids(n, cfg.vocab_size)


def check_length(prompt_tokens: int, cfg: ModelConfig, max_new_tokens: int, sized_by: str = "") -> None:
    """A prompt of that many tokens and the new ones fit the model's positions. sized_by: the flag
    that sized the prompt, named in the refusal (its default may be what ran over)."""
    if max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    total = prompt_tokens + max_new_tokens
    if total > cfg.max_position_embeddings:
        what = f"prompt of {prompt_tokens} tokens" + (f" ({sized_by})" if sized_by else "")
        # profile asks for no new tokens, and has no --max-new-tokens to name.
        if max_new_tokens:
            what += f" plus {max_new_tokens} new tokens (--max-new-tokens) is {total}"
        raise UsageError(f"{what}, over max_position_embeddings={cfg.max_position_embeddings}")


@dataclass(frozen=True)
class PromptSource:
    """The prompt flags a command was given (at most one kind of them), and its new tokens."""

    prompt: tuple[str, ...] | None = None  # --prompt, text through the tokenizer
    prompts_file: str | None = None
    token_ids: tuple[str, ...] | None = None  # --token-ids, each a list of ids as given
    token_ids_file: str | None = None
    max_new_tokens: int = 0


def prompt_ids(src: PromptSource, cfg: ModelConfig, ckpt: str | None) -> list[int]:
    """The prompt from --token-ids, --token-ids-file or --prompt (exactly one)."""
    prompts = prompt_list(src, cfg, ckpt)
    if len(prompts) > 1:
        raise UsageError("this command takes one prompt; give --prompt once")
    return prompts[0] if prompts else []


def prompt_list(src: PromptSource, cfg: ModelConfig, ckpt: str | None) -> list[list[int]]:
    """Every prompt given: --token-ids or --prompt (either repeatable), --token-ids-file or
    --prompts-file (one text prompt per line), one kind of them; [] when none is given. Text is
    tokenized with the checkpoint `ckpt`'s tokenizer."""
    given = [n for n in ("token_ids", "token_ids_file", "prompt", "prompts_file") if getattr(src, n) is not None]
    if len(given) > 1:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise UsageError(f"give one way of giving the prompt, not {flags}")
    if src.token_ids is not None:
        prompts = [parse_token_ids(text, "--token-ids") for text in src.token_ids]
        given_by = _each("--token-ids", len(prompts))
    elif src.token_ids_file is not None:
        prompts = [read_token_ids_file(src.token_ids_file)]
        given_by = [f"--token-ids-file {src.token_ids_file}"]
    elif src.prompt is not None:
        given_by = _each("--prompt", len(src.prompt))
        for text, by in zip(src.prompt, given_by):
            if not text:
                raise UsageError(f"{by} is empty: give at least one token")
        tok = load_tokenizer(ckpt)
        prompts = [tok.encode(t).ids for t in src.prompt]
    elif src.prompts_file is not None:
        prompts = _read_prompts_file(src.prompts_file, ckpt)
        given_by = [f"--prompts-file {src.prompts_file} line {n}" for n in range(1, len(prompts) + 1)]
    else:
        return []
    return [check_ids(ids, cfg, src.max_new_tokens, by) for ids, by in zip(prompts, given_by)]


def _each(flag: str, n: int) -> list[str]:
    """How each of n prompts a repeatable flag gave is named: the flag, numbered where repeated."""
    return [flag] if n == 1 else [f"{flag} #{i}" for i in range(1, n + 1)]


def _read_prompts_file(path: str, ckpt: str | None) -> list[list[int]]:
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts-file {path}: cannot read ({exc.strerror if isinstance(exc, OSError) else exc})") from None
    if not lines:
        raise UsageError(f"--prompts-file {path} is empty: give one prompt per line")
    for n, line in enumerate(lines, 1):
        # A line of spaces is text (a tokenizer gives it tokens); only an empty one is refused.
        if not line:
            raise UsageError(f"--prompts-file {path}: line {n} is empty (one prompt per line)")
    tok = load_tokenizer(ckpt, "--prompts-file", "pass --token-ids instead")
    return [tok.encode(line).ids for line in lines]

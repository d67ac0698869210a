"""The two generation requests, /v1/completions and /v1/chat/completions, parsed from their JSON
bodies and checked field by field into one Generation. A field this server does not know, or a
value it cannot honour (n=2, logprobs, a penalty), is refused by name rather than ignored: a
client must never get an answer to a question it did not ask."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from pocketllm.engine.generate import SamplingParams
from pocketllm.serving.errors import ApiError, bad

# At most this many stop strings, as OpenAI's API allows.
MAX_STOP = 4
# OpenAI's default max_tokens for a completion; a chat runs to the end of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16

# Fields either endpoint takes.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
           "presence_penalty", "frequency_penalty", "logit_bias", "return_token_ids"}
_COMPLETION = _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Fields accepted only at the value that asks for nothing this server does not do.
_NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False}
_ABSENT_ONLY = {"suffix", "top_logprobs"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Generation:
    """One checked request: what the scheduler runs and how the answer is shaped."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


@dataclass
class Limits:
    """What a request is checked against: the served model's name, context and vocab."""

    model: str
    max_len: int
    vocab_size: int


def parse_completion(body, limits: Limits, encode) -> Generation:
    """body: the parsed JSON; encode(text) -> token ids."""
    fields = _fields(body, _COMPLETION)
    if fields.get("logprobs") is not None:
        raise bad("logprobs is not supported by this server", "logprobs")
    if "prompt" not in fields:
        raise bad("prompt is required", "prompt")
    prompt = _prompt(fields["prompt"], encode, limits.vocab_size)
    return _generation(fields, limits, prompt, "prompt", COMPLETION_DEFAULT_MAX_TOKENS)


def parse_chat(body, limits: Limits, render) -> Generation:
    """render(messages) -> token ids, the chat template applied with the generation prompt."""
    fields = _fields(body, _CHAT)
    if fields.get("logprobs"):
        raise bad("logprobs is not supported by this server", "logprobs")
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        _check_message(m, i)
    if "max_tokens" in fields and "max_completion_tokens" in fields:
        raise bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    if "max_completion_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    prompt = render(messages)
    return _generation(fields, limits, prompt, "messages", None)


def _fields(body, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in body:
        if name not in known:
            raise bad(f"unrecognized request argument {name!r}: this server takes {', '.join(sorted(known))}", name)
    # An explicit null means the default, as in OpenAI's API.
    fields = {k: v for k, v in body.items() if v is not None}
    for name, neutral in _NEUTRAL.items():
        if name in fields and not _same(fields[name], neutral):
            raise bad(f"{name} must be {neutral!r} here: this server does not support other values, got {fields[name]!r}", name)
    for name in _ABSENT_ONLY:
        if name in fields:
            raise bad(f"{name} is not supported by this server", name)
    if fields.get("logit_bias"):
        raise bad("logit_bias is not supported by this server", "logit_bias")
    return fields


def _same(v, neutral) -> bool:
    """v is neutral, and of its kind: JSON's true is not the number 1."""
    if isinstance(neutral, bool):
        return v is neutral
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == neutral


def _generation(fields: dict, limits: Limits, prompt: list[int], prompt_param: str, default_max: int | None) -> Generation:
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: the name /v1/models lists", "model")
    if model != limits.model:
        raise ApiError(404, f"the model {model!r} does not exist: this server serves {limits.model!r}", "model", "model_not_found")
    if len(prompt) >= limits.max_len:
        raise bad(
            f"the prompt is {len(prompt)} tokens, and this server's context is {limits.max_len} (--max-len): "
            f"leave room for at least one new token", prompt_param, "context_length_exceeded",
        )
    room = limits.max_len - len(prompt)
    max_tokens = fields.get("max_tokens", default_max if default_max is not None else room)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    # A completion's default never fails a prompt that fits: it shrinks to the room left.
    if "max_tokens" not in fields:
        max_tokens = min(max_tokens, room)
    if max_tokens > room:
        raise bad(
            f"max_tokens={max_tokens} plus the prompt's {len(prompt)} tokens is {max_tokens + len(prompt)}, "
            f"over this server's context of {limits.max_len} (--max-len); at most {room} here", "max_tokens", "context_length_exceeded",
        )
    temperature = _number(fields, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(fields, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise bad(f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    # No seed: a fresh one, so that two sampled answers to one prompt differ, as with OpenAI's API.
    seed = fields.get("seed", secrets.randbits(63))
    if not _is_int(seed) or not 0 <= seed < 2**63:
        raise bad(f"seed must be an integer in [0, 2**63), got {seed!r}", "seed")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {stream!r}", "stream")
    include_usage = _stream_options(fields.get("stream_options"), stream)
    token_ids = fields.get("return_token_ids", False)
    if not isinstance(token_ids, bool):
        raise bad(f"return_token_ids must be true or false, got {token_ids!r}", "return_token_ids")
    user = fields.get("user", "")
    if not isinstance(user, str):
        raise bad(f"user must be a string, got {user!r}", "user")
    return Generation(prompt, max_tokens, SamplingParams(temperature, top_p, seed), _stop(fields.get("stop")), stream, include_usage, token_ids)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(fields: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = fields.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}", name)
    return float(v)


def _stream_options(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad(f"stream_options takes only {{\"include_usage\": bool}}, got {options!r}", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad(f"stream_options.include_usage must be true or false, got {include!r}", "stream_options")
    return include


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"stop must be a non-empty string or an array of them, got {stop!r}", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _prompt(prompt, encode, vocab: int) -> list[int]:
    """A string, an array of token ids, or an array holding one of those: this server answers one
    prompt per request."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("the prompt is empty", "prompt")
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise bad(f"token id {t} at position {i} of the prompt is outside the vocab [0, {vocab})", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"this server takes one prompt per request, got {len(prompt)}", "prompt")
    raise bad("prompt must be a non-empty string or a non-empty array of token ids", "prompt")


def _check_message(m, i: int) -> None:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{param} must be an object with role and content", param)
    role = m.get("role")
    if role not in _ROLES:
        raise bad(f"{param}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{param}.role")
    content = m.get("content")
    if content is None and role != "assistant":
        raise bad(f"{param}.content is required for role {role!r}", f"{param}.content")
    if content is not None and not isinstance(content, str):
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        )
        if not parts_ok:
            raise bad(f"{param}.content must be a string or an array of {{\"type\": \"text\", \"text\": ...}} parts", f"{param}.content")

"""The two generation requests, /v1/completions and /v1/chat/completions, parsed from their JSON
bodies and checked field by field into one Generation. The fields are OpenAI's and the sampling
extensions of vLLM's OpenAI-compatible server (top_k, min_p, repetition_penalty, ignore_eos, ...),
each applied. A field neither defines, or a value this server cannot honour (beam search), is
refused by name rather than ignored: a client must never get an answer to a question it did not
ask. A request is parsed into one Generation per choice: a completion's prompts (a string, token
ids, or an array of either) times n, numbered as vLLM numbers them."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace

from pocketllm.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pocketllm.serving.chat_fields import chat_prompt_options, checked_messages, template_kwargs, tools_of
from pocketllm.serving.errors import ApiError, bad
from pocketllm.serving.fields import check_model, checked_integer, checked_number, checked_token_ids, flag, integer, known_fields

# At most this many stop strings, as OpenAI's API allows.
MAX_STOP = 4
# OpenAI's default max_tokens for a completion; a chat runs to the end of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# At most this many choices in one request (its prompts times n): each is a sequence of its own,
# queued as separate requests would be.
MAX_CHOICES = 64

# Fields either endpoint takes: OpenAI's, then vLLM's.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
           "presence_penalty", "frequency_penalty", "logit_bias",
           "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "include_stop_str_in_output", "return_token_ids", "return_tokens_as_token_ids", "add_special_tokens",
           "spaces_between_special_tokens", "use_beam_search", "length_penalty", "priority"}
_COMPLETION = _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs", "echo", "response_format", "tools", "tool_choice",
                   "parallel_tool_calls", "store", "metadata", "service_tier", "modalities", "prompt_cache_key", "safety_identifier"}
# Fields accepted only at the value that asks for nothing this server does not do (vLLM's
# defaults for its own).
_NEUTRAL = {"use_beam_search": False, "length_penalty": 1, "priority": 0, "spaces_between_special_tokens": True}
# OpenAI's chat fields for what this server does not do (structured output, stored completions),
# accepted where they ask for nothing: clients and frameworks send them so. A type
# stands for any value of it; a tuple for any of its values.
_CHAT_NEUTRAL = {"echo": False, "response_format": {"type": "text"}, "parallel_tool_calls": bool,
                 "store": False, "metadata": dict, "service_tier": ("auto", "default"), "modalities": ["text"],
                 # Hints for OpenAI's routing and abuse checks, nothing about the answer (this
                 # server's prefix cache finds shared prefixes itself).
                 "prompt_cache_key": str, "safety_identifier": str}
_ABSENT_ONLY = {"suffix"}


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
    echo: bool = False
    prompt_text: str | None = None  # a completion's prompt as sent, when it came as text (echo shows it)
    include_stop: bool = False
    skip_special_tokens: bool = True
    tokens_as_ids: bool = False  # logprobs name tokens `token_id:N`
    # The choice's place in the answer: prompt i's j-th of n choices is i * n + j. The n choices of
    # one prompt take seeds seed, seed + 1, ..., so that sampled they differ, as in vLLM.
    index: int = 0
    n: int = 1
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage so far on every chunk
    # A chat answer's tools to read calls of (tool_choice "auto"), None: its text is all content.
    tools: list[dict] | None = None
    first_tool_only: bool = False  # parallel_tool_calls false: the first call alone
    reasoning: bool = False  # a chat answer's reasoning told from its content (reasoning.py)


@dataclass
class Limits:
    """What a request is checked against: the served model's name, context and vocab; and the
    sampling fields a request that leaves them out takes (the checkpoint's generation_config.json)."""

    model: str
    max_len: int
    vocab_size: int
    sampling_defaults: dict = field(default_factory=dict)
    reasoning_parser: str | None = None  # serve --reasoning-parser: chat answers' reasoning told from their content


def parse_completion(body, limits: Limits, encode) -> list[Generation]:
    """body: the parsed JSON; encode(text, add_special_tokens) -> token ids. One Generation per
    choice."""
    fields = known_fields(body, _COMPLETION, _NEUTRAL, _ABSENT_ONLY)
    if "prompt" not in fields:
        raise bad("prompt is required", "prompt")
    items = _prompt_items(fields["prompt"])
    n = _choices(fields, len(items))
    logprobs = fields.get("logprobs")
    if logprobs is not None:
        logprobs = checked_integer(logprobs, "logprobs", lambda n: 0 <= n <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
    echo = flag(fields, "echo", False)
    gens = []
    for i, item in enumerate(items):
        try:
            prompt = _prompt(item, lambda text: encode(text, flag(fields, "add_special_tokens", True)), limits.vocab_size)
            # Echoed with logprobs, the prompt's own are reported too, and max_tokens 0 scores the
            # prompt alone, as vLLM does (what evaluation harnesses ask for a loglikelihood).
            gen = _generation(fields, limits, prompt, "prompt", COMPLETION_DEFAULT_MAX_TOKENS, logprobs, least=0 if echo else 1)
            if echo and logprobs is not None:
                gen.sampling.prompt_logprobs = logprobs
        except ApiError as exc:
            if len(items) > 1:  # which of them
                exc.message = f"prompt[{i}]: {exc.message}"
                exc.args = (exc.message,)
            raise
        gen.echo, gen.prompt_text = echo, item if isinstance(item, str) else None
        gens.append(gen)
    return _each_choice(gens, n)


def _choices(fields: dict, prompts: int) -> int:
    """n, checked: with the prompts, at most MAX_CHOICES choices; best_of, if given, n (vLLM's
    engine has no best-of-more-than-n sampling either)."""
    n = checked_integer(fields.get("n", 1), "n", lambda n: 1 <= n <= MAX_CHOICES, f"in [1, {MAX_CHOICES}]")
    if prompts * n > MAX_CHOICES:
        raise bad(f"{prompts} prompts times n={n} is {prompts * n} choices; this server answers at most {MAX_CHOICES} in one request", "n")
    best_of = fields.get("best_of", n)
    if integer(best_of) != n:
        raise bad(f"best_of must be n ({n}) here: this server does not sample more choices than it returns, got {best_of!r}", "best_of")
    return n


def _each_choice(gens: list[Generation], n: int) -> list[Generation]:
    return [replace(g, index=i * n + j, n=n, sampling=replace(g.sampling, seed=(g.sampling.seed + j) % 2**64))
            for i, g in enumerate(gens) for j in range(n)]


def parse_chat(body, limits: Limits, render) -> list[Generation]:
    """render(messages, add_generation_prompt, continue_final_message, template_kwargs,
    add_special_tokens, tools) -> token ids, the chat template applied."""
    fields = known_fields(body, _CHAT, {**_NEUTRAL, **_CHAT_NEUTRAL}, _ABSENT_ONLY)
    messages = checked_messages(fields)
    # Both may come from a client that forwards one as the other: at one value they are one ask.
    if "max_tokens" in fields and "max_completion_tokens" in fields:
        if fields.pop("max_tokens") != fields["max_completion_tokens"]:
            raise bad("max_tokens and max_completion_tokens differ: give one of them, or both at one value", "max_completion_tokens")
    max_param = "max_tokens"
    if "max_completion_tokens" in fields:
        fields["max_tokens"], max_param = fields.pop("max_completion_tokens"), "max_completion_tokens"
    logprobs = None
    if flag(fields, "logprobs", False):
        logprobs = checked_integer(fields.get("top_logprobs", 0), "top_logprobs", lambda n: 0 <= n <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
    elif "top_logprobs" in fields:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    n = _choices(fields, 1)
    tools = tools_of(fields)
    prompt = render(messages, *chat_prompt_options(fields), template_kwargs(fields), flag(fields, "add_special_tokens", False), tools)
    gen = _generation(fields, limits, prompt, "messages", None, logprobs, max_param)
    # With tool_choice "auto" the answer is read for calls of them; with "none" they are only rendered.
    read = tools if fields.get("tool_choice", "auto") == "auto" else None
    gen = replace(gen, tools=read, first_tool_only=not flag(fields, "parallel_tool_calls", True), reasoning=limits.reasoning_parser is not None)
    return _each_choice([gen], n)


def _generation(fields: dict, limits: Limits, prompt: list[int], prompt_param: str, default_max: int | None,
                logprobs: int | None, max_param: str = "max_tokens", least: int = 1) -> Generation:
    """max_param: the field max_tokens came as (chat's max_completion_tokens), named in its errors;
    least: the fewest new tokens it may ask (0: the prompt echoed alone)."""
    # Left out, the served model, as vLLM takes it.
    check_model(fields, limits, required=False)
    if len(prompt) > limits.max_len - least:
        room_for = "leave room for at least one new token" if least else "it holds no more"
        raise bad(
            f"the prompt is {len(prompt)} tokens, and this server's context is {limits.max_len} (--max-len): {room_for}",
            prompt_param, "context_length_exceeded",
        )
    room = limits.max_len - len(prompt)
    max_tokens = checked_integer(fields.get("max_tokens", default_max if default_max is not None else room), max_param, lambda n: n >= least, f">= {least}")
    # A completion's default never fails a prompt that fits: it shrinks to the room left.
    if "max_tokens" not in fields:
        max_tokens = min(max_tokens, room)
    if max_tokens > room:
        raise bad(
            f"{max_param}={max_tokens} plus the prompt's {len(prompt)} tokens is {max_tokens + len(prompt)}, "
            f"over this server's context of {limits.max_len} (--max-len); at most {room} here", max_param, "context_length_exceeded",
        )
    stream = flag(fields, "stream", False)
    include_usage, continuous_usage = _stream_options(fields.get("stream_options"), stream)
    user = fields.get("user", "")
    if not isinstance(user, str):
        raise bad(f"user must be a string, got {user!r}", "user")
    sampling = _sampling({**limits.sampling_defaults, **fields}, limits.vocab_size, max_tokens, logprobs)
    return Generation(prompt, max_tokens, sampling, _stop(fields.get("stop")), stream, include_usage,
                      flag(fields, "return_token_ids", False), include_stop=flag(fields, "include_stop_str_in_output", False),
                      skip_special_tokens=flag(fields, "skip_special_tokens", True),
                      tokens_as_ids=flag(fields, "return_tokens_as_token_ids", False), continuous_usage=continuous_usage)


def check_sampling_defaults(defaults: dict, vocab: int) -> None:
    """Sampling fields a checkpoint sets as every request's defaults (its generation_config.json),
    checked as a request's own are: ApiError, naming the field, for a value no request could give."""
    _sampling(dict(defaults), vocab, 1, None)


def _sampling(fields: dict, vocab: int, max_tokens: int, logprobs: int | None) -> SamplingParams:
    temperature = checked_number(fields, "temperature", 1.0, 0.0, 2.0)
    top_p = checked_number(fields, "top_p", 1.0, 0.0, 1.0, above_lo=True)
    # No seed: a fresh one, so that two sampled answers to one prompt differ, as with OpenAI's API.
    # vLLM's range (a signed 64-bit integer); a negative one is taken as `generate --seed` takes it.
    seed = checked_integer(fields.get("seed", secrets.randbits(63)), "seed", lambda n: -(2**63) <= n < 2**63, "in [-2**63, 2**63)") % 2**64
    top_k = checked_integer(fields.get("top_k", 0), "top_k", lambda n: n >= -1, "-1 or 0 for every token, or k >= 1", sep=": ")
    repetition = fields.get("repetition_penalty", 1.0)
    if isinstance(repetition, bool) or not isinstance(repetition, (int, float)) or not 0 < repetition < float("inf"):
        raise bad(f"repetition_penalty must be a number > 0 (1 is none), got {repetition!r}", "repetition_penalty")
    repetition = float(repetition)
    min_tokens = checked_integer(fields.get("min_tokens", 0), "min_tokens", lambda n: 0 <= n <= max_tokens, f"in [0, max_tokens={max_tokens}]")
    stop_token_ids = checked_token_ids(fields.get("stop_token_ids", []), vocab, "stop_token_ids")
    if min_tokens and len(set(stop_token_ids)) >= vocab:
        raise bad(f"min_tokens={min_tokens} with every token in stop_token_ids leaves no token to generate", "min_tokens")
    return SamplingParams(
        temperature, top_p, seed, top_k=max(top_k, 0), min_p=checked_number(fields, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=repetition,
        presence_penalty=checked_number(fields, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=checked_number(fields, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(fields.get("logit_bias", {}), vocab),
        min_tokens=min_tokens, stop_token_ids=stop_token_ids,
        ignore_eos=flag(fields, "ignore_eos", False), logprobs=logprobs,
    )


def _logit_bias(bias, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]}."""
    if not isinstance(bias, dict):
        raise bad(f"logit_bias must be an object mapping token ids to numbers in [-100, 100], got {bias!r}", "logit_bias")
    out = []
    for key, value in bias.items():
        # isascii: str.isdigit (and int) also take other scripts' digits, which no token id is written in.
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < vocab):
            raise bad(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _stream_options(options, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): the last chunk carries the usage; with vLLM's
    continuous_usage_stats too, every chunk carries the usage so far (as vLLM's, only beside
    include_usage)."""
    if options is None:
        return False, False
    if not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad(f"stream_options takes only include_usage and continuous_usage_stats (true or false), got {options!r}", "stream_options")
    got = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad(f"stream_options.{name} must be true or false, got {value!r}", "stream_options")
        got.append(bool(value))  # null: the default, as at the top level
    return got[0], got[0] and got[1]


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"stop must be a non-empty string or an array of them, got {stop!r}", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _prompt_items(prompt) -> list:
    """A completion's prompts: a string, an array of token ids, or an array of those."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


def _prompt(prompt, encode, vocab: int) -> list[int]:
    """One prompt: a string or an array of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad("the prompt is empty", "prompt")
        return encode(prompt)
    ids = [integer(t) for t in prompt] if isinstance(prompt, list) else []
    if ids and all(t is not None for t in ids):
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise bad(f"token id {t} at position {i} of the prompt is outside the vocab [0, {vocab})", "prompt")
        return ids
    if ids and any(isinstance(t, (int, float)) and not isinstance(t, bool) for t in prompt):
        # An array of ids with one that is not (a harness's null where a tokenizer has no BOS).
        i = next(i for i, t in enumerate(ids) if t is None)
        raise bad(f"token id at position {i} of the prompt is {json.dumps(prompt[i])}, not an integer", "prompt")
    raise bad("prompt must be a non-empty string or a non-empty array of token ids", "prompt")



"""Logprobs as each endpoint answers them. A token is named by its own decode (special tokens
included, a byte cut from its character as U+FFFD), and -inf, which JSON cannot carry, is
written as -9999.0, as OpenAI's API and vLLM write it.

/v1/completions (`logprobs: N`): {tokens, token_logprobs, top_logprobs, text_offset}, each
position's top_logprobs holding the N likeliest tokens and the chosen one.
/v1/chat/completions (`logprobs: true`, `top_logprobs: N`): {content: [{token, logprob, bytes,
top_logprobs: the N likeliest, likeliest first}]}."""

from __future__ import annotations

FLOOR = -9999.0


def _name(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(tokenizer, logprobs: list, offset: int) -> tuple[dict, int]:
    """The logprobs object for these tokens, the first starting at character `offset` of the
    choice's text; and the offset after the last."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        name = _name(tokenizer, lp.token)
        top = {_name(tokenizer, t): _value(v) for t, v in lp.top}
        top.setdefault(name, _value(lp.logprob))
        out["tokens"].append(name)
        out["token_logprobs"].append(_value(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(name)
    return out, offset


def chat_logprobs(tokenizer, logprobs: list) -> dict:
    return {"content": [{**_entry(tokenizer, lp.token, lp.logprob),
                         "top_logprobs": [_entry(tokenizer, t, v) for t, v in lp.top]} for lp in logprobs]}


def _entry(tokenizer, token: int, logprob: float) -> dict:
    name = _name(tokenizer, token)
    return {"token": name, "logprob": _value(logprob), "bytes": list(name.encode("utf-8", errors="replace"))}

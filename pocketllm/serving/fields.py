"""The fields of a request's JSON body, read and checked one by one: each value of the wrong kind or
out of range is a 400 naming the field (and the value as given), as OpenAI's API and vLLM answer.
Shared by the generation requests (protocol.py), chat's own fields (chat_fields.py) and
/tokenize."""

from __future__ import annotations

import json

from pocketllm.serving.errors import ApiError, bad


def known_fields(body, known: set[str], neutral: dict, absent_only: frozenset = frozenset()) -> dict:
    """The body's fields, nulls left out (an explicit null means the default, as in OpenAI's API):
    any name outside `known` given a value, a name of `neutral` at another value than its (a value
    or a type, or a tuple of values), or a name of `absent_only` given, is a 400 naming it. A null
    asks for nothing, whatever its name: clients that write out every field of OpenAI's (as null
    where unset) send fields this server does not take."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name, value in body.items():
        if name not in known and value is not None:
            raise bad(f"unrecognized request argument {name!r}: this server takes {', '.join(sorted(known))}", name)
    fields = {k: v for k, v in body.items() if v is not None}
    for name, value in neutral.items():
        if name in fields and not _same(fields[name], value):
            raise bad(f"{name} must be {_shown(value)} here: this server does not support other values, got {fields[name]!r}", name)
    for name in absent_only:
        if name in fields:
            raise bad(f"{name} is not supported by this server", name)
    return fields


def check_model(fields: dict, limits, required: bool) -> None:
    """The request's model, where given (or `required`), is the served one (limits.model)."""
    if "model" not in fields and not required:
        return
    model = fields.get("model")
    if model is None or model == "":
        raise bad("model is empty: give the name /v1/models lists, or leave it out", "model")
    if not isinstance(model, str):
        raise bad(f"model must be a string, the name /v1/models lists; got {model!r}", "model")
    if model != limits.model:
        raise ApiError(404, f"the model {model!r} does not exist: this server serves {limits.model!r}", "model", "model_not_found")


def _same(v, neutral) -> bool:
    """v is neutral, and of its kind: JSON's true is not the number 1."""
    if isinstance(neutral, tuple):
        return any(_same(v, n) for n in neutral)
    if isinstance(neutral, type):
        return isinstance(v, neutral)
    if isinstance(neutral, bool):
        return v is neutral
    if isinstance(neutral, (str, list, dict)):
        return type(v) is type(neutral) and v == neutral
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == neutral


def _shown(neutral) -> str:
    if isinstance(neutral, tuple):
        return " or ".join(map(_shown, neutral))
    if isinstance(neutral, type):
        return {bool: "true or false", dict: "an object", str: "a string"}[neutral]
    return json.dumps(neutral)


def integer(v) -> int | None:
    """v as an integer field takes it: a JSON integer, or a float with no fraction (2.0, as some
    clients' JSON writes a whole number, and vLLM's parser takes it); None for anything else (JSON's
    true is not 1)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def checked_integer(v, param: str, ok, what: str, sep: str = " ") -> int:
    """An integer field's value, refused by name (and as given) where it is not an integer `what`
    says, ok(n) false."""
    n = integer(v)
    if n is None or not ok(n):
        raise bad(f"{param} must be an integer{sep}{what}, got {v!r}", param)
    return n


def token_ids(ids, vocab: int) -> list[int] | None:
    """ids as a list of token ids in [0, vocab); None when it is not one."""
    if not isinstance(ids, list):
        return None
    out = [integer(t) for t in ids]
    return out if all(t is not None and 0 <= t < vocab for t in out) else None


def checked_number(fields: dict, name: str, default: float, lo: float, hi: float, above_lo: bool = False) -> float:
    """fields[name] in [lo, hi] ((lo, hi] with above_lo), one message for every way it is not."""
    v = fields.get(name, default)
    inside = lambda x: (lo < x if above_lo else lo <= x) and x <= hi  # noqa: E731
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not inside(v):
        raise bad(f"{name} must be a number in {'(' if above_lo else '['}{lo:g}, {hi:g}], got {v!r}", name)
    return float(v)


def flag(fields: dict, name: str, default: bool) -> bool:
    v = fields.get(name, default)
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {v!r}", name)
    return v


def checked_token_ids(ids, vocab: int, name: str) -> tuple[int, ...]:
    out = token_ids(ids, vocab)
    if out is None:
        raise bad(f"{name} must be an array of token ids in [0, {vocab}), got {ids!r}", name)
    return tuple(out)

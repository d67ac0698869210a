"""Tool calls read out of a chat answer's text, as this model family writes them: each call in a
`<tool_call>` ... `</tool_call>` block, its body either Qwen3.5's XML form

    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>

or the JSON of Qwen3's (Hermes) form, {"name": NAME, "arguments": {...}}. An XML value is typed by
the tool's JSON schema for that argument (a string stays as written; numbers, booleans, objects
and arrays are read as JSON), as vLLM's qwen3_coder parser types them. The text before the first
block is the message's content; text after a reasoning block's `</think>` only is searched. A block
that does not parse leaves the whole text as content: a client gets what the model wrote, never a
call it did not make."""

from __future__ import annotations

import json
import re
import uuid

from pocketllm.serving.reasoning import CLOSE as CLOSE_REASONING
from pocketllm.serving.text import ends_in_start_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def split_tool_calls(text: str, tools: list[dict], first_only: bool = False) -> tuple[str | None, list[dict]]:
    """(content, calls): the text's tool calls as OpenAI's message carries them ({id, type,
    function: {name, arguments as a JSON string}}) and the content before them (None where blank);
    (text, []) where it holds none, or a block that does not parse. first_only: the first call
    alone (parallel_tool_calls false)."""
    start = text.rfind(CLOSE_REASONING)
    start = 0 if start < 0 else start + len(CLOSE_REASONING)
    at = text.find(OPEN, start)
    if at < 0:
        return text, []
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    calls = []
    for block in _BLOCK.finditer(text, at):
        call = _call(block.group(1), schemas)
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[:at]
    return (content if content.strip() else None), calls[:1] if first_only else calls


def _call(body: str, schemas: dict) -> dict | None:
    named = _FUNCTION.fullmatch(body)
    if named is not None:
        name = named.group(1).strip()
        if name not in schemas:
            return None
        properties = schemas[name].get("properties") or {}
        arguments = {k.strip(): _typed(_value(v), properties.get(k.strip())) for k, v in _PARAMETER.findall(named.group(2))}
    else:
        try:
            given = json.loads(body)
        except ValueError:
            return None
        if not isinstance(given, dict) or given.get("name") not in schemas:
            return None
        name, arguments = given["name"], given.get("arguments", given.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _value(raw: str) -> str:
    """A parameter's text as the model wrote it between its tags: one newline each side is the
    form's, not the value's."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def _typed(value: str, schema) -> object:
    kinds = (schema or {}).get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds:
        return value
    if value.strip() == "null" and ("null" in kinds or None in kinds):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if kinds == [None]:
        # No schema for it: JSON where the text is a number, boolean, object or array, else text.
        return parsed if not isinstance(parsed, str) else value
    wanted = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list, "null": type(None)}
    if any(k in wanted and isinstance(parsed, wanted[k]) and not (k in ("integer", "number") and isinstance(parsed, bool)) for k in kinds):
        return parsed
    return value


class ToolCallStream:
    """A streamed answer's content as it may be sent: the text up to a tool call's opening tag (the
    first after a reasoning block's end), the end of it held back while it could still be that
    tag's beginning; from the tag on, everything waits for the end (finish), which parses it. Only
    the held text's new part is searched: a piece costs its own length, not the answer's."""

    def __init__(self, tools: list[dict], first_only: bool = False):
        self.tools, self.first_only = tools, first_only
        self.pieces: list[str] = []  # the whole answer, for finish to parse
        self.held = ""  # not sent yet
        self.sent = 0  # characters sent
        self.opened = -1  # where in `held` a call's opening tag begins
        self.searched = 0  # how much of `held` has been searched for either tag

    def feed(self, piece: str) -> str:
        """What of the text so far (with `piece`) can go out as content now."""
        self.pieces.append(piece)
        self.held += piece
        # A tag may straddle the searched part's end.
        think = self.held.rfind(CLOSE_REASONING, max(0, self.searched - len(CLOSE_REASONING) + 1))
        after = 0 if think < 0 else think + len(CLOSE_REASONING)
        if think >= 0:
            self.opened = -1  # a tag inside the reasoning opened no call
        if self.opened < 0:
            self.opened = self.held.find(OPEN, max(after, self.searched - len(OPEN) + 1))
        end = self.opened if self.opened >= 0 else len(self.held) - ends_in_start_of(self.held, OPEN)
        out, self.held = self.held[:end], self.held[end:]
        self.sent += end
        self.searched = len(self.held)
        self.opened = 0 if self.opened >= 0 else -1
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not yet sent, the calls) once the answer is whole."""
        content, calls = split_tool_calls("".join(self.pieces), self.tools, self.first_only)
        if not calls:
            return self.held, []
        return (content or "")[self.sent :], calls


def with_parsed_arguments(messages: list[dict]) -> list[dict]:
    """The messages as a chat template renders them: an assistant message's tool calls carry their
    arguments as an object (OpenAI's API sends them as a JSON string, which a template iterating
    them, as Qwen3.5's does, cannot read), as vLLM hands them over."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_parsed(c) for c in calls]}
        out.append(m)
    return out


def _parsed(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}

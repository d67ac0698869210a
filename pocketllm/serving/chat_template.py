"""A checkpoint's chat template rendered the way transformers' apply_chat_template renders it: the
same sandboxed jinja2 environment (trim_blocks, lstrip_blocks, loop controls, its tojson,
raise_exception and strftime_now), the special tokens as variables, keys whose value is null
dropped from each message, and the rendered text encoded without adding special tokens. The
template is tokenizer_config.json's `chat_template` (a string, or a list of named templates of
which `default` is used), or chat_template.jinja beside it, as newer transformers saves it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from pocketllm.errors import UsageError
from pocketllm.serving.errors import bad
from pocketllm.serving.tool_calls import with_parsed_arguments

# The special-token names transformers passes to a template as variables.
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # jinja2's own tojson escapes HTML characters, which a prompt must keep as they are.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._jinja = jinja2
        self.template = env.from_string(source)
        self.special_tokens = dict(special_tokens or {})
        # OpenAI's "developer" role is its newer name for the system prompt. Templates that do not
        # name it (Qwen3.5's among them) refuse it as an unknown role or leave it out, so there it
        # reaches the template as "system", as vLLM and llama.cpp pass it.
        self.takes_developer = "developer" in source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, extra: dict | None = None, continue_final: bool = False,
               tools: list[dict] | None = None) -> str:
        """The prompt text; a template that refuses the messages (raise_exception, or any error
        rendering them) is the request's fault: a 400 naming what the template said. `extra`
        holds more template variables (a request's chat_template_kwargs), over the special tokens.
        continue_final: the text ends where the final message's text does (its turn left open),
        as transformers' continue_final_message renders it. tools: the request's, as given (the
        template renders them as transformers' apply_chat_template passes them). An assistant
        message's tool calls reach it with their arguments as objects; a "developer" message
        reaches a template that does not name that role as "system"."""
        chat = [{k: v for k, v in m.items() if v is not None} for m in with_parsed_arguments(messages)]
        if not self.takes_developer:
            chat = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in chat]
        if continue_final:
            chat[-1] = _marked(chat[-1])
        variables = {**self.special_tokens, **(extra or {})}
        try:
            text = self.template.render(messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables)
        except self._jinja.exceptions.TemplateError as exc:
            raise bad(f"the chat template refused these messages: {exc}", "messages") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise bad(f"the chat template could not render these messages: {type(exc).__name__}: {exc}", "messages") from None
        return _cut_at_mark(text) if continue_final else text


# Put after the final message's text to find where it ends once rendered. Its trailing space shows
# whether the template kept the text as given or trimmed its end (then the end is trimmed too).
_MARK = "<|pocketllm-final-message-ends|> "


def _marked(message: dict) -> dict:
    """The message with the mark after its text (its last text part, for content parts)."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _MARK}
    if isinstance(content, list):
        for i in range(len(content) - 1, -1, -1):
            part = content[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts = [*content[:i], {**part, "text": part["text"] + _MARK}, *content[i + 1 :]]
                return {**message, "content": parts}
    raise bad("continue_final_message: the final message has no text to continue", "messages")


def _cut_at_mark(text: str) -> str:
    at = text.rfind(_MARK.strip())
    if at < 0:
        raise bad("continue_final_message: the chat template leaves out the final message's text, so the prompt cannot end "
                  "inside it", "messages")
    return text[:at] if text.startswith(_MARK, at) else text[:at].rstrip()


def load_chat_template(ckpt: str) -> ChatTemplate | None:
    """The checkpoint's template, None when it has none; a malformed one is a usage error."""
    directory = Path(ckpt)
    config_path = directory / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{config_path} is not readable JSON: {exc}") from None
        if not isinstance(config, dict):
            raise UsageError(f"{config_path} must hold a JSON object")
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = directory / "chat_template.jinja"
    if source is None and jinja_file.is_file():
        source = jinja_file.read_text()
    if source is None:
        return None
    if not isinstance(source, str):
        raise UsageError(f"{config_path}: chat_template must be a string or a list of {{name, template}}")
    import jinja2

    try:
        return ChatTemplate(source, special_tokens(config))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise UsageError(f"{config_path}: the chat template does not parse: {exc} (line {exc.lineno})") from None


def special_tokens(config: dict) -> dict[str, str]:
    """The special tokens tokenizer_config.json names, as strings: each may be written as the
    token itself or as an added-token object holding it under `content`."""
    out = {}
    for name in _SPECIAL:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return out

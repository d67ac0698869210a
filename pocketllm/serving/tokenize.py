"""/tokenize and /detokenize in the shapes of vLLM's server: a prompt (or chat messages, rendered
by the chat template) to its token ids, and token ids back to text. Load generators call them to
check that their tokenizer counts as the server's does."""

from __future__ import annotations

from pocketllm.serving.admission import encode
from pocketllm.serving.errors import bad
from pocketllm.serving.chat_fields import chat_prompt_options, checked_messages, template_kwargs, tools_of
from pocketllm.serving.fields import check_model, flag, known_fields, token_ids
from pocketllm.serving.protocol import Limits

_COMMON = {"model", "add_special_tokens", "return_token_strs"}
_TEXT = _COMMON | {"prompt"}
_CHAT = _COMMON | {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"}


def tokenize(body, limits: Limits, tokenizer, render) -> dict:
    """body: {prompt} or {messages}; render(messages, add_generation_prompt, continue_final_message,
    template_kwargs, add_special_tokens, tools) -> ids, None when the model has no chat template."""
    chat = isinstance(body, dict) and "messages" in body
    if chat and "prompt" in body:
        raise bad("give prompt or messages, not both", "prompt")
    fields = known_fields(body, _CHAT if chat else _TEXT, {})
    check_model(fields, limits, required=False)
    if chat:
        if render is None:
            raise bad("this model has no chat template (tokenizer_config.json's chat_template): tokenize a prompt instead", "messages")
        messages = checked_messages(fields)
        ids = render(messages, *chat_prompt_options(fields), template_kwargs(fields), flag(fields, "add_special_tokens", False), tools_of(fields, choice=False))
    else:
        prompt = fields.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt (a string) or messages is required", "prompt")
        ids = encode(tokenizer, prompt, flag(fields, "add_special_tokens", True))
    strs = [tokenizer.id_to_token(t) for t in ids] if flag(fields, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": limits.max_len, "tokens": ids, "token_strs": strs}


def detokenize(body, limits: Limits, tokenizer) -> dict:
    fields = known_fields(body, {"model", "tokens"}, {})
    check_model(fields, limits, required=False)
    tokens = token_ids(fields.get("tokens"), limits.vocab_size)
    if tokens is None:
        raise bad(f"tokens must be an array of token ids in [0, {limits.vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}

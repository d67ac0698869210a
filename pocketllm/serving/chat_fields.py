"""A chat request's own fields: its messages (roles, text content), the template options (a
generation prompt, continuing the final message, template variables) and the tools a template
renders. Shared by /v1/chat/completions (protocol.py) and /tokenize."""

from __future__ import annotations

from pocketllm.serving.errors import bad
from pocketllm.serving.fields import flag

_ROLES = ("system", "developer", "user", "assistant", "tool")
# Template variables a request's chat_template_kwargs may not replace.
_TEMPLATE_OWN = {"messages", "tools", "documents", "add_generation_prompt"}


def chat_prompt_options(fields: dict) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as vLLM takes them: the prompt ends with
    the template's opening of the assistant's turn (the default), or inside the final message, for
    the model to go on with it; not both."""
    generation_prompt, continue_final = flag(fields, "add_generation_prompt", True), flag(fields, "continue_final_message", False)
    if generation_prompt and continue_final:
        raise bad("continue_final_message needs add_generation_prompt: false (the prompt cannot both end inside the final "
                  "message and open a new one)", "continue_final_message")
    return generation_prompt, continue_final


def tools_of(fields: dict, choice: bool = True) -> list[dict] | None:
    """A request's tools, for the chat template to render (None: none given). A chat completion
    (`choice`) takes them with tool_choice "auto" (the default with tools: the model's tool calls
    are read out of its text, tool_calls.py) or "none" (rendered, never read); "required" and a
    named function would need the sampling held to a call's form, which this server does not do.
    /tokenize renders them as they come."""
    if choice and fields.get("tool_choice", "auto") not in ("auto", "none"):
        raise bad(f'tool_choice must be "auto" or "none" here, got {fields["tool_choice"]!r}: "required" and a named function '
                  'need the sampling held to a tool call\'s form, which this server does not do', "tool_choice")
    tools = fields.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be an array of {\"type\": \"function\", \"function\": {\"name\": ...}} objects", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str) or not function["name"] or \
                not isinstance(function.get("parameters", {}), dict) or not isinstance(function.get("description", ""), str):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": a non-empty string, \"description\"?: "
                      f"a string, \"parameters\"?: an object}}}}, got {tool!r}", f"tools[{i}]")
    return tools


def template_kwargs(fields: dict) -> dict:
    """A request's chat_template_kwargs, checked: the variables the server passes itself are not
    the request's to replace."""
    kwargs = fields.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k not in _TEMPLATE_OWN for k in kwargs):
        raise bad(f"chat_template_kwargs must be an object of template variables other than {', '.join(sorted(_TEMPLATE_OWN))}",
                  "chat_template_kwargs")
    return kwargs


def checked_messages(fields: dict) -> list[dict]:
    """A request's messages, each checked (check_message)."""
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        check_message(m, i)
    return messages


def check_message(m, i: int) -> None:
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

"""serve's chat template rendering against transformers' apply_chat_template (the test oracle):
the same text for templates that use the special tokens, raise_exception, loop controls, tojson,
namespace and content parts; a template that refuses the messages is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from pocketllm.commands.make_checkpoint import CHAT_TEMPLATE, write_byte_tokenizer
from pocketllm.errors import UsageError
from pocketllm.serving.chat_template import ChatTemplate, load_chat_template
from pocketllm.serving.errors import ApiError

# Shaped like the templates checkpoints ship: Qwen's ChatML with a system default and tool JSON,
# a Llama-style one with bos/eos and role checks.
QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(users=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{% continue %}{% endif %}"
    "{%- if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{% else %}{{ message.content | tojson }}{% endif %}"
    "{%- if message.tool_calls is defined %}{{ message.tool_calls | tojson(indent=2) }}{% endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    "{{- '<!-- users: ' ~ ns.users ~ ' -->' }}"
)
LLAMA_LIKE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}"
    "{% endfor %}"
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

CHATS = {
    "plain": [{"role": "user", "content": "Hello there"}],
    "system and turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! <b>&</b> ünïcode"},
        {"role": "user", "content": "Again"},
    ],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " two"}]}],
    "null fields dropped": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": None}],
}


def hf_tokenizer(tmp_path, template: str, special: dict):
    from transformers import PreTrainedTokenizerFast

    write_byte_tokenizer(tmp_path / "tokenizer.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), **special)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template,special", [(CHAT_TEMPLATE, {}), (QWEN_LIKE, {}), (LLAMA_LIKE, SPECIAL)], ids=["make-checkpoint", "qwen-like", "llama-like"])
@pytest.mark.parametrize("chat", list(CHATS), ids=list(CHATS))
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen", "nogen"])
def test_renders_what_transformers_renders(tmp_path, template, special, chat, generation_prompt):
    messages = CHATS[chat]
    ours = ChatTemplate(template, special)
    hf = hf_tokenizer(tmp_path, template, special)
    try:
        want = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    except Exception as exc:
        with pytest.raises(ApiError) as err:
            ours.render(messages, add_generation_prompt=generation_prompt)
        assert err.value.status == 400 and str(exc) in err.value.message
        return
    assert ours.render(messages, add_generation_prompt=generation_prompt) == want


@pytest.mark.parametrize("template,special", [(CHAT_TEMPLATE, {}), (QWEN_LIKE, {}), (LLAMA_LIKE, SPECIAL)], ids=["make-checkpoint", "qwen-like", "llama-like"])
@pytest.mark.parametrize("final", ["Sure, the answer is", "trailing space ", [{"type": "text", "text": "a"}, {"type": "text", "text": " b"}]],
                         ids=["text", "trailing-space", "parts"])
def test_continuing_the_final_message_renders_what_transformers_renders(tmp_path, template, special, final):
    """The prompt ends inside the final (assistant) message, its turn left open: where the text ends
    as given, or trimmed where the template trims it."""
    if template == QWEN_LIKE and isinstance(final, list):
        final = "parts are JSON in this template"
    messages = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": final}]
    want = hf_tokenizer(tmp_path, template, special).apply_chat_template(messages, continue_final_message=True, tokenize=False)
    got = ChatTemplate(template, special).render(messages, add_generation_prompt=False, continue_final=True)
    assert got == want and not got.endswith(("<|im_end|>\n", "</s>"))


def test_a_final_message_the_template_leaves_out_cannot_be_continued():
    with pytest.raises(ApiError) as err:
        ChatTemplate("{{ messages[0]['content'] }}").render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                                          add_generation_prompt=False, continue_final=True)
    assert err.value.status == 400 and "leaves out the final message's text" in err.value.message


def test_a_template_that_refuses_the_messages_is_a_400_with_its_words():
    with pytest.raises(ApiError) as err:
        ChatTemplate(LLAMA_LIKE, SPECIAL).render([{"role": "assistant", "content": "first"}])
    assert err.value.status == 400 and err.value.param == "messages" and "must alternate" in err.value.message


def test_a_developer_message_is_the_system_prompt_to_a_template_without_that_role():
    """OpenAI's "developer" role renders as the system prompt where the template knows only
    "system" (as Qwen3.5's, which raises on any other role), and as itself where it names it."""
    strict = ("{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('Unexpected message role.') }}{%- endif %}"
              "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}")
    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate(strict).render(chat, add_generation_prompt=False) == ChatTemplate(strict).render(as_system, add_generation_prompt=False)
    assert "<|im_start|>system\nBe brief." in ChatTemplate(strict).render(chat, add_generation_prompt=False)
    naming = strict.replace("['system', 'user', 'assistant']", "['system', 'developer', 'user', 'assistant']")
    assert "<|im_start|>developer\nBe brief." in ChatTemplate(naming).render(chat, add_generation_prompt=False)


def test_loaded_from_tokenizer_config_or_chat_template_jinja(tmp_path):
    assert load_chat_template(str(tmp_path)) is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_chat_template(str(tmp_path)).render([{"role": "user", "content": "a"}]) == "a!"
    config = {"chat_template": [{"name": "tool_use", "template": "no"}, {"name": "default", "template": "{{ bos_token }}x"}],
              "bos_token": {"content": "<s>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(str(tmp_path)).render([]) == "<s>x"


def test_a_template_that_does_not_parse_is_a_usage_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(UsageError, match="does not parse"):
        load_chat_template(str(tmp_path))


# Qwen's way of putting a request's tools in the system turn.
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_a_requests_tools_render_as_transformers_renders_them(tmp_path):
    messages = CHATS["plain"]
    want = hf_tokenizer(tmp_path, QWEN_TOOLS, {}).apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    got = ChatTemplate(QWEN_TOOLS).render(messages, tools=TOOLS)
    assert got == want and '"name": "get_weather"' in got
    assert "<tools>" not in ChatTemplate(QWEN_TOOLS).render(messages)

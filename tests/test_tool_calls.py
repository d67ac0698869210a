"""Tool calls read out of a chat answer's text (pocketllm/serving/tool_calls.py): both forms this
model family writes, each value typed by the tool's schema, content before the calls, what is
left as text (a malformed or cut block, an unknown tool, a call inside the reasoning), the streamed
form giving what the whole one gives wherever the text is cut, and an assistant message's
arguments handed to a template as an object. tests/test_serve_sampling.py has the server's side."""

from __future__ import annotations

import json

import pytest

from pocketllm.serving.chat_template import ChatTemplate
from pocketllm.serving.tool_calls import ToolCallStream, split_tool_calls, with_parsed_arguments

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"}, "metric": {"type": "boolean"},
    "where": {"type": "object"}, "hours": {"type": "array"}, "code": {"type": "string"}, "note": {"type": ["string", "null"]},
}}}}
NOTE = {"type": "function", "function": {"name": "note"}}
TOOLS = [WEATHER, NOTE]


def xml(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_xml_calls_take_their_values_types_from_the_tools_schema():
    text = "Checking both.\n" + xml("get_weather", city="Paris", days="3", scale="2.5", metric="true", where='{"lat": 1}',
                                     hours="[1, 2]", code="007", note="line one\nline two") + "\n" + xml("note", text="hi", n="4", flag="false")
    content, calls = split_tool_calls(text, TOOLS)
    assert content == "Checking both.\n"
    assert arguments(calls) == [
        ("get_weather", {"city": "Paris", "days": 3, "scale": 2.5, "metric": True, "where": {"lat": 1}, "hours": [1, 2], "code": "007",
                         "note": "line one\nline two"}),
        # No schema for these: JSON where the value reads as a number, boolean, object or array.
        ("note", {"text": "hi", "n": 4, "flag": False}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # A value that does not read as its schema's type is kept as written.
    assert arguments(split_tool_calls(xml("get_weather", days="three", metric="yes"), TOOLS)[1]) == [("get_weather", {"days": "three", "metric": "yes"})]
    # parallel_tool_calls false: the first alone.
    assert arguments(split_tool_calls(text, TOOLS, first_only=True)[1]) == arguments(calls)[:1]


def test_json_calls_and_blank_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "note", "arguments": "{\\"text\\": \\"x\\"}"}\n</tool_call>'
    content, calls = split_tool_calls("  \n" + text, TOOLS)
    assert content is None and arguments(calls) == [("get_weather", {"city": "Oslo", "days": 2}), ("note", {"text": "x"})]


@pytest.mark.parametrize("text", [
    "no call here",
    xml("get_weather", city="Rome")[: -len("</tool_call>")],  # cut by max_tokens
    xml("get_weather", city="Rome").replace("</function>", ""),
    xml("unknown_tool", city="Rome"),  # a tool the request did not offer
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
    "Sure: " + xml("get_weather", city="Rome") + "<tool_call>\nnot a call\n</tool_call>",
    "<think>\nmaybe " + xml("get_weather", city="Rome") + "\n</think>\n\nNo call after all.",
])
def test_what_is_not_a_whole_call_of_an_offered_tool_stays_text(text):
    assert split_tool_calls(text, TOOLS) == (text, [])


def test_only_the_text_after_the_reasoning_is_read_for_calls():
    text = "<think>\nI could call " + xml("note", text="a") + " but no\n</think>\n\n" + xml("note", text="b")
    content, calls = split_tool_calls(text, TOOLS)
    assert content == text[: text.rindex("<tool_call>")] and arguments(calls) == [("note", {"text": "b"})]


STREAMED = [
    "Let me look.\n" + xml("get_weather", city="Paris", days="3") + "\n" + xml("note", text="<tool"),
    "a < b, and <tool_ca is not a tag; <tool_call> is cut here",
    "<think>\n" + xml("note", text="x") + "\n</think>\n" + xml("note", text="y"),
    "plain text ending in <tool_cal",
    "no call",
]


@pytest.mark.parametrize("text", STREAMED)
def test_a_streamed_answer_sends_the_content_and_calls_the_whole_one_has_wherever_it_is_cut(text):
    want_content, want_calls = split_tool_calls(text, TOOLS)
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:
        stream, sent, held = ToolCallStream(TOOLS), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            got = stream.feed(text[a:b])
            sent += got
            # What has gone out is never part of a call, nor the start of an opening tag yet to come.
            assert (want_content or "").startswith(sent) if want_calls else text.startswith(sent)
            held.append(len(text[:b]) - len(sent))
        rest, calls = stream.finish()
        assert sent + rest == (want_content or "" if want_calls else text), cuts
        assert arguments(calls) == arguments(want_calls)
    # Text with no opening tag in it goes out as it comes, but for a tag's possible beginning.
    if "<tool_call>" not in text:
        assert max(held) < len("<tool_call>") or "<think>" in text


def test_an_assistant_messages_tool_call_arguments_reach_the_template_as_an_object():
    # A template iterating the arguments, as Qwen3.5's does.
    template = ChatTemplate("{% for m in messages %}{% for c in m.get('tool_calls', []) %}{{ c.function.name }}("
                            "{% for k, v in c.function.arguments|items %}{{ k }}={{ v }};{% endfor %}){% endfor %}{% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    assert template.render(messages, add_generation_prompt=False) == "get_weather(city=Paris;days=3;)"
    assert messages[1]["tool_calls"][0] is call  # the request's own messages are left as they came
    # Arguments that are not a JSON object's text are passed as they are.
    odd = {"function": {"name": "f", "arguments": "not json"}}
    assert with_parsed_arguments([{"role": "assistant", "tool_calls": [odd]}]) == [{"role": "assistant", "tool_calls": [odd]}]

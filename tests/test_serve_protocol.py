"""serve's request parsing: each field checked by name (booleans are not numbers, null means the
default), limits against the context, and what the server cannot honour refused rather than
ignored; and /metrics' figures from a controlled clock."""

from __future__ import annotations

import pytest

from pocketllm.serving.errors import ApiError
from pocketllm.serving.metrics import Metrics, parse
from pocketllm.serving.protocol import Limits, parse_chat, parse_completion

LIMITS = Limits("m", max_len=100, vocab_size=1000)


def encode(text: str, add_special_tokens: bool = False) -> list[int]:
    return [ord(c) for c in text]


def completions(**fields):
    """Every choice's Generation."""
    return parse_completion({"model": "m", "prompt": "hello", **fields}, LIMITS, encode)


def completion(**fields):
    (g,) = completions(**fields)
    return g


def chats(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat(body, LIMITS, lambda messages, *options: encode("".join(m["content"] for m in messages)))


def chat(**fields):
    (g,) = chats(**fields)
    return g


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 96}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": 1}}, "stream_options"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"n": True}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"best_of": 2}, "best_of"),
    ({"prompt": ["a"] * 33, "n": 2}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": 1}, "echo"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"min_tokens": 3, "stop_token_ids": list(range(1000))}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"add_special_tokens": "no"}, "add_special_tokens"),
    ({"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"priority": 1}, "priority"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"1000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {"\u0665": 1}}, "logit_bias"),
    ({"guided_json": {}}, "guided_json"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": [[1], [1000]]}, "prompt"),
    ({"prompt": [1, 1000]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": "x" * 100}, "prompt"),
    ({"tools": []}, "tools"),
])
def test_bad_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as err:
        completion(**fields)
    assert err.value.status == 400 and err.value.param == param, err.value.message


@pytest.mark.parametrize("fields,message", [
    ({"model": 5}, "model must be a string, the name /v1/models lists; got 5"),
    ({"prompt": [None, 116, 104]}, "token id at position 0 of the prompt is null, not an integer"),
    ({"prompt": [116, 1.5]}, "token id at position 1 of the prompt is 1.5, not an integer"),
    ({"prompt": [[5], [116, "a"]]}, "prompt[1]: token id at position 1 of the prompt is \"a\", not an integer"),
    ({"model": ""}, "model is empty: give the name /v1/models lists, or leave it out"),
    ({"n": 65}, "n must be an integer in [1, 64], got 65"),
    ({"prompt": ["a", "x" * 100]}, "prompt[1]: the prompt is 100 tokens, and this server's context is 100 (--max-len): leave room for at least one new token"),
    ({"repetition_penalty": -1}, "repetition_penalty must be a number > 0 (1 is none), got -1"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0 (1 is none), got 0"),
    # One range for top_p, whichever side a value falls off (they said [0, 1] and (0, 1]).
    ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p must be a number in (0, 1], got 1.5"),
])
def test_the_400_says_what_is_wrong_with_the_value(fields, message):
    with pytest.raises(ApiError) as err:
        completion(**fields)
    assert err.value.status == 400 and err.value.message == message, err.value.message


def test_a_whole_number_written_as_a_float_is_a_max_tokens_and_a_fraction_is_not():
    assert completion(max_tokens=2.0).max_tokens == 2
    with pytest.raises(ApiError) as err:
        completion(max_tokens=2.5)
    assert err.value.param == "max_tokens"


def test_defaults_and_nulls():
    g = completion(temperature=None, stop=None, max_tokens=None)
    assert (g.prompt, g.max_tokens, g.sampling.temperature, g.sampling.top_p, g.stop, g.stream) == (encode("hello"), 16, 1.0, 1.0, (), False)
    # Without a seed each request draws its own.
    assert completion().sampling.seed != completion().sampling.seed
    # A completion's default max_tokens shrinks to what the context leaves; a chat's is all of it.
    assert completion(prompt="x" * 90).max_tokens == 10
    assert chat().max_tokens == 98
    assert chat(max_completion_tokens=7).max_tokens == 7
    # Both at one value are one ask (a client forwarding one as the other); at two they are a 400.
    assert chat(max_completion_tokens=7, max_tokens=7).max_tokens == 7
    with pytest.raises(ApiError) as err:
        chat(max_completion_tokens=7, max_tokens=8)
    assert err.value.param == "max_completion_tokens" and "differ" in err.value.message
    g = completion(prompt=[[5, 6, 7]], stop="\n", stream=True, stream_options={"include_usage": True}, seed=3, n=1, user="u")
    assert (g.prompt, g.stop, g.include_usage, g.sampling.seed) == ([5, 6, 7], ("\n",), True, 3)
    # A null asks for nothing, under any name: OpenAI's fields this server does not take, written
    # out as null by clients that send every field, are no error; given a value, they are.
    assert chat(functions=None, audio=None, prediction=None).prompt == chat().prompt
    assert completion(suffix=None).prompt == completion().prompt
    with pytest.raises(ApiError) as err:
        chat(functions=[])
    assert err.value.status == 400 and err.value.param == "functions"


def test_a_request_is_one_generation_per_choice_numbered_as_vllm_numbers_them():
    gens = completions(prompt=["ab", [7, 8, 9]], n=3, seed=5, best_of=3, max_tokens=4)
    assert [g.index for g in gens] == list(range(6)) and {g.n for g in gens} == {3}
    assert [g.prompt for g in gens] == [encode("ab")] * 3 + [[7, 8, 9]] * 3
    assert [g.prompt_text for g in gens] == ["ab"] * 3 + [None] * 3
    # A prompt's choices sample from seeds of their own, each prompt's from the one given.
    assert [g.sampling.seed for g in gens] == [5, 6, 7] * 2
    assert {g.max_tokens for g in gens} == {4}
    # Each prompt's default max_tokens is its own room.
    assert [g.max_tokens for g in completions(prompt=["x" * 90, "y"])] == [10, 16]
    assert [g.index for g in chats(n=2)] == [0, 1] and chats(n=2)[0].prompt == chats(n=2)[1].prompt
    # An array of one prompt is that prompt.
    assert completion(prompt=["hi"]).prompt_text == "hi"


def test_echo_with_logprobs_asks_for_the_prompts_and_max_tokens_0_scores_the_prompt_alone():
    g = completion(echo=True, logprobs=2, max_tokens=0)
    assert (g.max_tokens, g.sampling.logprobs, g.sampling.prompt_logprobs) == (0, 2, 2)
    assert completion(echo=True, max_tokens=0).sampling.prompt_logprobs is None
    # A prompt the whole context long can be scored (no new token), not continued.
    assert completion(prompt="x" * 100, echo=True, logprobs=0, max_tokens=0).max_tokens == 0
    assert completion(prompt="x" * 100, echo=True, logprobs=0).max_tokens == 0  # the default shrinks to the room
    with pytest.raises(ApiError, match="leave room for at least one new token"):
        completion(prompt="x" * 100, logprobs=0)
    with pytest.raises(ApiError, match="it holds no more"):
        completion(prompt="x" * 101, echo=True, max_tokens=0)
    assert completion(logprobs=2).sampling.prompt_logprobs is None


def test_the_checkpoints_sampling_defaults_fill_what_a_request_leaves_out():
    limits = Limits("m", max_len=100, vocab_size=1000, sampling_defaults={"temperature": 0.6, "top_k": 20, "top_p": 0.95})
    p = parse_completion({"model": "m", "prompt": "hello", "top_p": 0.5, "temperature": None}, limits, encode)[0].sampling
    # Left out or null: the checkpoint's; given: the request's.
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.6, 20, 0.5, 0.0)
    greedy = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}, limits,
                        lambda messages, *options: encode("hi"))[0].sampling
    assert greedy.temperature == 0 and greedy.plain_greedy


def test_vllm_fields_reach_the_sampling_params():
    g = completion(top_k=-1, min_p=0.1, repetition_penalty=1.2, presence_penalty=-1, frequency_penalty=0.5, logit_bias={"5": -2},
                   min_tokens=3, stop_token_ids=[7], ignore_eos=True, logprobs=0, include_stop_str_in_output=True,
                   skip_special_tokens=False, use_beam_search=False, priority=0, length_penalty=1, spaces_between_special_tokens=True)
    p = g.sampling
    assert (p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0, 0.1, 1.2, -1.0, 0.5)
    assert (p.logit_bias, p.min_tokens, p.stop_token_ids, p.ignore_eos, p.logprobs) == (((5, -2.0),), 3, (7,), True, 0)
    assert g.include_stop and not g.skip_special_tokens and completion(echo=True).echo
    # What a load generator sends (a neutral repetition penalty) keeps a greedy request on the batch's argmax.
    assert completion(temperature=0, repetition_penalty=1.0, ignore_eos=True, stop_token_ids=[7]).sampling.plain_greedy
    assert not completion(temperature=0, repetition_penalty=1.1).sampling.plain_greedy
    assert chat(logprobs=True).sampling.logprobs == 0 and chat(logprobs=True, top_logprobs=5).sampling.logprobs == 5
    assert chat(logprobs=False).sampling.logprobs is None and completion().sampling.logprobs is None
    for fields, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"), ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
                          ({"add_generation_prompt": 1}, "add_generation_prompt"), ({"continue_final_message": True}, "continue_final_message")]:
        with pytest.raises(ApiError) as err:
            chat(**fields)
        assert err.value.param == param, fields


def test_the_model_must_be_the_served_one():
    with pytest.raises(ApiError) as err:
        completion(model="other")
    assert (err.value.status, err.value.code) == (404, "model_not_found")
    # Left out (or null), the served one, as vLLM takes it.
    assert parse_completion({"prompt": "x"}, LIMITS, encode)[0].prompt == encode("x")
    assert parse_chat({"model": None, "messages": [{"role": "user", "content": "x"}]}, LIMITS, lambda m, *o: encode("x"))[0].prompt == encode("x")


def test_whole_numbers_written_as_floats_are_taken_in_every_integer_field():
    g = completion(max_tokens=3.0, seed=7.0, top_k=2.0, min_tokens=1.0, logprobs=1.0, stop_token_ids=[5.0], prompt=[1.0, 2.0])
    assert (g.max_tokens, g.sampling.seed, g.sampling.top_k, g.sampling.min_tokens, g.sampling.logprobs) == (3, 7, 2, 1, 1)
    assert g.sampling.stop_token_ids == (5,) and g.prompt == [1, 2] and all(type(t) is int for t in g.prompt)
    assert type(g.sampling.logprobs) is int and chat(logprobs=True, top_logprobs=2.0).sampling.logprobs == 2
    for name in ("seed", "top_k", "min_tokens", "logprobs", "stop_token_ids"):
        with pytest.raises(ApiError) as err:
            completion(**{name: [1.5] if name == "stop_token_ids" else 1.5})
        assert err.value.param == name


def test_a_negative_seed_is_taken_as_generate_takes_it():
    assert completion(seed=-1).sampling.seed == 2**64 - 1 and completion(seed=2**63 - 1).sampling.seed == 2**63 - 1


def test_max_completion_tokens_is_named_in_its_errors():
    for value in (0, 5000):
        with pytest.raises(ApiError) as err:
            chat(max_completion_tokens=value)
        assert err.value.param == "max_completion_tokens" and err.value.message.startswith("max_completion_tokens"), err.value.message


def test_openais_chat_fields_are_taken_where_they_ask_for_nothing_and_refused_otherwise():
    neutral = dict(response_format={"type": "text"}, tools=[], tool_choice="none", parallel_tool_calls=False, store=False,
                   metadata={"k": "v"}, service_tier="auto", modalities=["text"], prompt_cache_key="k", safety_identifier="u")
    assert chat(**neutral).prompt == chat().prompt
    assert chat(stream=True, stream_options={"include_usage": None}).include_usage is False
    # vLLM's continuous usage: the usage so far on every chunk, beside include_usage only.
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert (chat(stream=True, stream_options=both).continuous_usage, chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage) == (True, False)
    for name, value in (("response_format", {"type": "json_object"}),
                        ("store", True), ("service_tier", "flex"), ("modalities", ["text", "audio"]), ("parallel_tool_calls", 1),
                        ("prompt_cache_key", 5), ("safety_identifier", ["u"])):
        with pytest.raises(ApiError) as err:
            chat(**{name: value})
        assert err.value.status == 400 and err.value.param == name, err.value.message
    with pytest.raises(ApiError) as err:
        chat(tool_choice="required")
    assert err.value.param == "tool_choice" and err.value.message.startswith('tool_choice must be "auto" or "none" here, got \'required\'')


def test_tools_reach_the_template_and_with_tool_choice_auto_the_answer_is_read_for_their_calls():
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    for choice, read in (({"tool_choice": "none"}, None), ({"tool_choice": "auto"}, [tool]), ({}, [tool])):
        seen = []
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], **choice}
        (gen,) = parse_chat(body, LIMITS, lambda messages, *options: seen.append(options[-1]) or [1])
        assert seen == [[tool]] and gen.tools == read and not gen.first_tool_only, choice
    (gen,) = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "parallel_tool_calls": False}, LIMITS, lambda *a: [1])
    assert gen.first_tool_only
    # What would need the sampling held to a call's form, and tools that are not tools.
    named = {"type": "function", "function": {"name": "f"}}
    for fields, param in (({"tools": [tool], "tool_choice": "required"}, "tool_choice"), ({"tools": [tool], "tool_choice": named}, "tool_choice"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0]"),
                          ({"tools": [{"type": "function"}]}, "tools[0]"),
                          ({"tools": [tool, {"type": "function", "function": {"name": ""}}], "tool_choice": "none"}, "tools[1]"),
                          ({"tools": {"f": tool}, "tool_choice": "none"}, "tools")):
        with pytest.raises(ApiError) as err:
            chat(**fields)
        assert err.value.status == 400 and err.value.param == param, err.value.message


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content"),
    (["hi"], "messages[0]"),
])
def test_bad_messages(messages, param):
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": messages}, LIMITS, lambda m, *options: [1])
    assert err.value.param == param


def test_metrics_rates_and_time_to_first_token():
    now = [100.0]
    m = Metrics(clock=lambda: now[0])
    now[0] = 130.0
    for _ in range(50):
        m.tokens(1)
    now[0] = 135.0
    # 50 tokens in the last 10 s window.
    assert m.tokens_per_second() == pytest.approx(5.0)
    now[0] = 141.0
    assert m.tokens_per_second() == 0
    for s in (0.1, 0.2, 0.3, 0.4):
        m.first_token(s)
    m.admitted(7)
    m.ended_with("length")
    got = parse(m.render(running=2, waiting=3))
    assert got["pocketllm_requests_running"] == 2 and got["pocketllm_requests_waiting"] == 3
    assert got['pocketllm_time_to_first_token_seconds{quantile="0.5"}'] == pytest.approx(0.2)
    assert got["pocketllm_time_to_first_token_seconds_count"] == 4 and got["pocketllm_time_to_first_token_seconds_sum"] == pytest.approx(1.0)
    assert got['pocketllm_requests_ended_total{how="length"}'] == 1 and got["pocketllm_prompt_tokens_total"] == 7
    assert got["pocketllm_generation_tokens_total"] == 50

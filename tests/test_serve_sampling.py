"""The request surface of vLLM's OpenAI-compatible server, applied for real: the real `openai`
client (the extensions in extra_body) against the app served by uvicorn in this process, on the
real Scheduler over a tiny fp32 engine. Each parameter's effect is checked against a plain
one-sequence loop over the same engine with the reference processors: penalties, min_tokens,
ignore_eos, stop_token_ids, logprobs (the log_softmax of the engine's logits), top_k and min_p,
echo, skip_special_tokens, include_stop_str_in_output; /tokenize and /detokenize round-trip; bad
values and unknown fields are 400s naming the field."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time

import openai
import pytest
import torch
from conftest import ServePair, feed, metaspace_tokenizer, tiny_engine, words

from pocketllm.commands.make_checkpoint import CHAT_TEMPLATE, write_byte_tokenizer
from pocketllm.engine.sampling import apply_penalties_reference
from pocketllm.engine.scheduler import Scheduler
from pocketllm.serving.app import Served, build_app
from pocketllm.serving.chat_template import ChatTemplate
from pocketllm.serving.protocol import Limits

MODEL = "tiny-surface"
MAX_LEN = 256
# A prompt whose greedy continuation repeats a token (at its 7th), so every penalty changes it.
PROMPT = "abc abc abc"
NEW = 24
# Added tokens <256>..<259> are special: skip_special_tokens leaves them out of the text.
SPECIAL = range(256, 260)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("surface") / "tokenizer.json"
    write_byte_tokenizer(path)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(f"<{i}>", normalized=False, special=True) for i in SPECIAL])
    tok.add_tokens([AddedToken(f"<{i}>", normalized=False, special=False) for i in range(260, 1000)])
    assert tok.get_vocab_size() == 1000 and tok.token_to_id("<256>") == 256
    return tok


def reference(engine, prompt: list[int], new: int, stop=(), min_tokens: int = 0, rep=1.0, freq=0.0, presence=0.0, bias=None):
    """Greedy tokens by a plain loop over one sequence, with the reference penalty and the stop
    tokens masked until min_tokens; and the logits each token was chosen from."""
    engine.reserve_slots(1, len(prompt) + new)
    logits = feed(engine, prompt)
    out, rows = [], []
    while len(out) < new:
        rows.append(logits.float().clone())
        x = logits.float().clone()
        if len(out) < min_tokens:
            x[list(stop)] = float("-inf")
        if bias:
            for t, b in bias.items():
                x[t] += b
        x = apply_penalties_reference(x, prompt, out, rep, freq, presence)
        out.append(int(x.argmax()))
        if out[-1] in stop:
            break
        logits = feed(engine, out[-1:], len(prompt) + len(out) - 1)
    return out, rows


@pytest.fixture(scope="module")
def eos(engine):
    """The served eos id: a token the prompt's greedy continuation reaches at its 4th step, first."""
    ids, _ = reference(engine, list(PROMPT.encode()), NEW)
    return next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])


class Server:
    def __init__(self, engine, tokenizer, eos: int, template: str = CHAT_TEMPLATE, reasoning_parser: str | None = None):
        import uvicorn

        self.loop = ServePair(Scheduler(engine, max_running=4, max_len=MAX_LEN))
        limits = Limits(MODEL, MAX_LEN, 1000, reasoning_parser=reasoning_parser)
        served = Served(limits, tokenizer, ChatTemplate(template), (eos,), self.loop.client)
        config = uvicorn.Config(build_app(served), host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="off")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.loop.start()
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uvicorn.started and time.monotonic() < deadline:
            time.sleep(0.01)
        self.port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=30, max_retries=0)

    def post(self, path: str, body) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        with contextlib.closing(conn):
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.loop.begin_shutdown()
        assert self.loop.join(10)


@pytest.fixture(scope="module")
def server(tokenizer, eos):
    # An engine of its own (the same seeded weights): the reference loop runs on `engine` while
    # the server's scheduler holds its slots.
    s = Server(tiny_engine(), tokenizer, eos)
    yield s
    s.close()


@pytest.fixture(scope="module")
def metaspace_server(eos):
    s = Server(tiny_engine(), metaspace_tokenizer(1000), eos)
    yield s
    s.close()


# Added tokens that spell tool calls and reasoning, for logit_bias to make the model write them: a
# content line ending in the opening tag's first half, the rest of an XML call; a JSON call whole;
# reasoning ending in the closing tag's first half, its rest and the content; reasoning closed.
TOOL_TEXT = {
    300: "Let me check.\n<tool",
    301: "_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    302: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    303: "Thinking it over.</thi",
    304: "nk>\n\nThe answer.",
    305: "Hmm.\n</think>\n\n",
}
# make-checkpoint's template, its generation prompt opening a reasoning block as Qwen3.5's does.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def spelling_tokenizer(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("tools") / "tokenizer.json"
    write_byte_tokenizer(path)
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens([AddedToken(TOOL_TEXT.get(i, f"<{i}>"), normalized=False, special=False) for i in range(256, 1000)])
    assert tok.get_vocab_size() == 1000 and tok.decode([301]) == TOOL_TEXT[301]
    return tok


@pytest.fixture(scope="module")
def tools_server(eos, spelling_tokenizer):
    s = Server(tiny_engine(), spelling_tokenizer, eos)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reasoning_server(eos, spelling_tokenizer):
    s = Server(tiny_engine(), spelling_tokenizer, eos, THINKING_TEMPLATE, reasoning_parser="qwen3")
    yield s
    s.close()


@pytest.mark.timeout(60)
def test_with_a_reasoning_parser_the_reasoning_comes_apart_from_the_content_whole_and_streamed(reasoning_server, tools_server):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    # logit_bias makes the model write the first token, its repetition penalty (halving it) the second.
    cases = [
        (dict(logit_bias={"303": 100, "304": 90}, max_tokens=2), "Thinking it over.", "The answer.", None),
        # Cut inside its reasoning: all of it reasoning.
        (dict(logit_bias={"303": 100}, max_tokens=1), "Thinking it over.</thi", "", None),
        # Reasoning, then a tool call: the call is read from the content.
        (dict(logit_bias={"305": 100, "302": 90}, max_tokens=2, tools=[WEATHER]), "Hmm.\n", None, {"city": "Oslo"}),
    ]
    for ask, reasoning, content, call in cases:
        ask = dict(model=MODEL, messages=messages, temperature=0, extra_body={"repetition_penalty": 2}, **ask)
        whole = reasoning_server.client.chat.completions.create(**ask).choices[0]
        extra = whole.message.model_extra
        assert (extra["reasoning"], extra["reasoning_content"], whole.message.content) == (reasoning, reasoning, content), whole
        assert [json.loads(c.function.arguments) for c in whole.message.tool_calls or []] == ([call] if call else [])
        chunks = [c.choices[0] for c in reasoning_server.client.chat.completions.create(**ask, stream=True) if c.choices]
        assert "".join(c.delta.model_extra.get("reasoning") or "" for c in chunks) == reasoning
        assert "".join(c.delta.content or "" for c in chunks) == (content or "")
        assert [json.loads(tc.function.arguments) for c in chunks for tc in c.delta.tool_calls or []] == ([call] if call else [])
    # Without the parser, the same tokens are all content.
    plain = tools_server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"repetition_penalty": 2},
                                                         **cases[0][0]).choices[0].message
    assert plain.content == TOOL_TEXT[303] + TOOL_TEXT[304] and "reasoning" not in plain.model_extra


@pytest.mark.timeout(60)
def test_with_tool_choice_auto_the_models_tool_calls_come_back_as_tool_calls_whole_and_streamed(tools_server):
    # logit_bias (and a presence penalty, for the second token) makes the model write the calls.
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    cases = [({"300": 100, "301": 99}, 2, "Let me check.\n", {"city": "Paris", "days": 3}), ({"302": 100}, 1, None, {"city": "Oslo"})]
    for bias, new, content, args in cases:
        ask = dict(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=new, temperature=0, logit_bias=bias, presence_penalty=2)
        whole = tools_server.client.chat.completions.create(**ask).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == content, whole
        (call,) = whole.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and json.loads(call.function.arguments) == args
        chunks = [c.choices[0] for c in tools_server.client.chat.completions.create(**ask, stream=True) if c.choices]
        # The content line goes out without the opening tag's half that ends its token.
        assert "".join(c.delta.content or "" for c in chunks) == (content or "")
        streamed = [tc for c in chunks for tc in c.delta.tool_calls or []]
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [(0, "get_weather", args)]
        assert streamed[0].id.startswith("chatcmpl-tool-") and [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
        # tool_choice "none": the same tokens, as text.
        plain = tools_server.client.chat.completions.create(**ask, tool_choice="none").choices[0]
        assert plain.message.content == "".join(TOOL_TEXT[int(t)] for t in bias) and not plain.message.tool_calls
        assert plain.finish_reason == "length"


@pytest.mark.timeout(60)
def test_the_text_continues_the_prompts_with_a_decoder_that_drops_a_first_space(metaspace_server):
    # A Metaspace decoder drops the leading space of a sequence's first word: the completion's
    # first word is not one, and keeps it, whole or streamed, as vLLM's text does.
    c = complete(metaspace_server, prompt=[1, 2, 3], max_tokens=5, ignore_eos=True)
    assert c.text == words(c.model_extra["token_ids"]) and c.text.startswith(" w")
    chunks = list(metaspace_server.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text


@pytest.mark.timeout(60)
def test_n_choices_and_a_list_of_prompts_are_the_requests_one_at_a_time(server, tokenizer):
    # Choice j of n is the one request with seed + j; prompt i's choices are i * n + j; the usage
    # counts each prompt once, as vLLM's does.
    prompts, n, seed = [PROMPT, [65, 66, 67, 10]], 2, 11
    args = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=seed, extra_body={"return_token_ids": True, "ignore_eos": True})
    alone = {(i, j): server.client.completions.create(prompt=p, **{**args, "seed": seed + j})
             for i, p in enumerate(prompts) for j in range(n)}
    r = server.client.completions.create(prompt=prompts, n=n, **args)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        one = alone[divmod(c.index, n)].choices[0]
        assert (c.text, c.model_extra["token_ids"]) == (one.text, one.model_extra["token_ids"])
        assert c.model_extra["prompt_token_ids"] == alone[divmod(c.index, n)].model_extra["prompt_token_ids"]
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) == 4  # sampled: all differ
    prompt_tokens = sum(alone[i, 0].usage.prompt_tokens for i in range(len(prompts)))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 4 * 6)
    # Streamed, each choice's chunks carry its index and add up to its text; chat the same.
    chunks = list(server.client.completions.create(prompt=prompts, n=n, stream=True, stream_options={"include_usage": True}, **args))
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in r.choices] and chunks[-1].usage.completion_tokens == 24
    assert all(ch.usage is None for ch in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk carries the usage so far, each prompt counted once.
    chunks = list(server.client.completions.create(prompt=prompts, n=n, stream=True, **args,
                                                   stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 24 and not chunks[-1].choices
    assert {ch.usage.prompt_tokens for ch in chunks} == {prompt_tokens}
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0, extra_body={"ignore_eos": True})
    whole = server.client.chat.completions.create(n=3, seed=seed, **chat)
    assert [whole.choices[j].message.content for j in range(3)] == \
        [server.client.chat.completions.create(seed=seed + j, **chat).choices[0].message.content for j in range(3)]
    deltas = {}
    for ch in server.client.chat.completions.create(n=3, seed=seed, stream=True, **chat):
        for c in ch.choices:
            deltas[c.index] = deltas.get(c.index, "") + (c.delta.content or "")
    assert deltas == {j: whole.choices[j].message.content for j in range(3)}


def complete(server, prompt=PROMPT, max_tokens=NEW, **extra):
    """A greedy completion; fields OpenAI's client does not name travel in extra_body."""
    named = {k: extra.pop(k) for k in ("logprobs", "echo", "stop", "temperature", "seed", "logit_bias") if k in extra}
    args = {"temperature": 0} | named
    c = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                         extra_body={"return_token_ids": True, **extra}, **args).choices[0]
    return c


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fields,kw", [
    ({"repetition_penalty": 1.8}, dict(rep=1.8)),
    ({"repetition_penalty": 0.5}, dict(rep=0.5)),
    ({"frequency_penalty": 1.5}, dict(freq=1.5)),
    ({"presence_penalty": 2.0}, dict(presence=2.0)),
    ({"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5}, dict(rep=1.3, freq=0.5, presence=0.5)),
    ({"logit_bias": {"65": 3.0}}, dict(bias={65: 3.0})),
], ids=["repetition", "repetition<1", "frequency", "presence", "all", "logit_bias"])
def test_penalties_change_a_greedy_continuation_as_the_reference_computes(server, engine, eos, fields, kw):
    prompt = list(PROMPT.encode())
    plain, _ = reference(engine, prompt, NEW)
    want, _ = reference(engine, prompt, NEW, **kw)
    got = complete(server, ignore_eos=True, **fields)
    assert got.model_extra["token_ids"] == want and want != plain


@pytest.mark.timeout(60)
def test_eos_min_tokens_ignore_eos_and_stop_token_ids(server, engine, eos, tokenizer):
    prompt = list(PROMPT.encode())
    plain, _ = reference(engine, prompt, NEW, (eos,))
    alone = complete(server)
    assert alone.model_extra["token_ids"] == plain and plain[-1] == eos and alone.finish_reason == "stop"
    assert alone.model_extra["stop_reason"] is None
    # min_tokens holds eos off: the continuation goes on past it, as the masked reference does.
    held, _ = reference(engine, prompt, NEW, (eos,), min_tokens=len(plain) + 2)
    c = complete(server, min_tokens=len(plain) + 2)
    assert c.model_extra["token_ids"] == held and eos not in held[: len(plain) + 2]
    # ignore_eos runs to max_tokens through eos, which then shows in the text like any token.
    through, _ = reference(engine, prompt, NEW, ())
    c = complete(server, ignore_eos=True)
    assert (c.model_extra["token_ids"], c.finish_reason) == (through, "length") and eos in through
    assert c.text == tokenizer.decode(through)
    # A stop token id ends the request with finish_reason stop, its text left out unless asked for.
    at = next(i for i, t in enumerate(through) if i >= 2 and t not in through[:i])
    stop = through[at]
    c = complete(server, ignore_eos=True, stop_token_ids=[stop])
    assert (c.model_extra["token_ids"], c.finish_reason, c.model_extra["stop_reason"]) == (through[: at + 1], "stop", stop)
    assert c.text == tokenizer.decode(through[:at])
    c = complete(server, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert c.text == tokenizer.decode(through[: at + 1])


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
def test_an_echoed_prompts_logprobs_come_first_whole_streamed_and_for_each_prompt(server, engine, tokenizer):
    # A loglikelihood request of an evaluation harness: several prompts, echo, logprobs, max_tokens
    # 0 or 1. Each prompt position's logprob is the log_softmax of the engine's logits of the
    # position before it; the new tokens' offsets follow the prompt's text.
    prompts = ["abc abd", "x y <300> z"]
    for p in prompts:
        ids = tokenizer.encode(p).ids
        want = torch.log_softmax(feed(engine, ids, all_logits=True).double(), dim=-1)
        for max_tokens in (0, 2):
            c = complete(server, prompt=p, max_tokens=max_tokens, echo=True, logprobs=2, ignore_eos=True)
            lp = c.logprobs
            assert c.text.startswith(p) and len(lp.tokens) == len(ids) + max_tokens
            assert lp.tokens[: len(ids)] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert lp.token_logprobs[1 : len(ids)] == pytest.approx([float(want[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)
            for i in range(1, len(ids)):
                names = {tokenizer.decode([t], skip_special_tokens=False) for t in torch.topk(want[i - 1], 2).indices.tolist() + [ids[i]]}
                assert set(lp.top_logprobs[i]) == names
            assert lp.text_offset[: len(ids)] == [len(tokenizer.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids))]
            plain = complete(server, prompt=p, max_tokens=max_tokens, logprobs=2, ignore_eos=True) if max_tokens else None
            assert lp.text_offset[len(ids) :] == ([len(p) + o for o in plain.logprobs.text_offset] if plain else [])
            # Streamed: the prompt's part comes on the first chunk, and the parts add up to the whole.
            chunks = list(server.client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0, echo=True, logprobs=2,
                                                           stream=True, extra_body={"ignore_eos": True}))
            parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
            assert len(parts[0].tokens) >= len(ids)
            assert [v for part in parts for v in part.token_logprobs] == lp.token_logprobs
            assert [v for part in parts for v in part.text_offset] == lp.text_offset
    both = server.client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=1)
    for p, c in zip(prompts, both.choices, strict=True):
        alone = complete(server, prompt=p, max_tokens=1, echo=True, logprobs=1)
        assert (c.text, c.logprobs.token_logprobs) == (alone.text, alone.logprobs.token_logprobs)


def test_logprobs_are_the_log_softmax_of_the_engines_logits(server, engine, eos, tokenizer):
    prompt = list(PROMPT.encode())
    ids, rows = reference(engine, prompt, 8, (eos,))
    want = [torch.log_softmax(r, dim=-1) for r in rows]
    c = complete(server, max_tokens=8, logprobs=3)
    lp = c.logprobs
    assert c.model_extra["token_ids"] == ids and lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs == pytest.approx([float(w[t]) for w, t in zip(want, ids)], abs=1e-4)
    for top, w, t in zip(lp.top_logprobs, want, ids):
        names = {tokenizer.decode([i], skip_special_tokens=False) for i in torch.topk(w, 3).indices.tolist() + [t]}
        assert set(top) == names
    # Each token's offset is where its text begins in the answer's (a token's own decode, U+FFFD
    # for part of a character, is not its share of the text), in order.
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0 and lp.text_offset[-1] <= len(c.text)
    for i, (offset, t) in enumerate(zip(lp.text_offset, ids)):
        assert c.text[offset:].startswith(tokenizer.decode([t])) or "\ufffd" in tokenizer.decode(ids[: i + 1]) or t == eos
    # "é" as its two byte tokens (195 169): the bias puts 195 first, the presence penalty 169 next.
    split = complete(server, max_tokens=2, logprobs=0, prompt="ab", logit_bias={"195": 100, "169": 99}, presence_penalty=2)
    assert split.model_extra["token_ids"] == [195, 169] and split.text == "é"
    assert split.logprobs.tokens == ["\ufffd", "\ufffd"] and split.logprobs.text_offset == [0, 0]
    by_id = complete(server, max_tokens=8, logprobs=0, return_tokens_as_token_ids=True).logprobs
    assert by_id.tokens == [f"token_id:{t}" for t in ids] and by_id.token_logprobs == lp.token_logprobs
    assert by_id.top_logprobs == [{f"token_id:{t}": v} for t, v in zip(ids, lp.token_logprobs)]
    # Streamed, the chunks' logprobs add up to the same.
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True))
    assert [v for ch in chunks for v in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    # Chat: logprobs true with top_logprobs N, each position's N likeliest, likeliest first.
    messages = [{"role": "user", "content": "hi"}]
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                              top_logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    chat_prompt = r.model_extra["prompt_token_ids"]
    chat_ids, chat_rows = reference(engine, chat_prompt, 4)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [tokenizer.decode([t], skip_special_tokens=False) for t in chat_ids]
    for e, row, t in zip(content, chat_rows, chat_ids):
        w = torch.log_softmax(row, dim=-1)
        assert e.logprob == pytest.approx(float(w[t]), abs=1e-4) and e.bytes == list(e.token.encode())
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(torch.topk(w, 2).values.tolist(), abs=1e-4)
    # bytes are each token's own (OpenAI's): "é" over its two byte tokens joins to its UTF-8,
    # though each token's name is U+FFFD; a special token's are its text's.
    def chat_bytes(bias: dict, new: int):
        r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=new, temperature=0, logprobs=True,
                                                  logit_bias=bias, presence_penalty=2,
                                                  extra_body={"return_token_ids": True, "ignore_eos": True, "skip_special_tokens": False})
        content = r.choices[0].logprobs.content
        return r.choices[0].model_extra["token_ids"], r.choices[0].message.content, [e.token for e in content], [e.bytes for e in content]

    assert chat_bytes({"195": 100, "169": 99}, 2) == ([195, 169], "é", ["\ufffd", "\ufffd"], [[195], [169]])
    assert chat_bytes({"256": 100}, 1) == ([256], "<256>", ["<256>"], [list(b"<256>")])


@pytest.mark.timeout(60)
def test_top_k_1_and_min_p_1_sample_the_greedy_token(server, engine):
    greedy = complete(server, ignore_eos=True).model_extra["token_ids"]
    assert complete(server, ignore_eos=True, temperature=1.5, seed=3, top_k=1).model_extra["token_ids"] == greedy
    assert complete(server, ignore_eos=True, temperature=1.5, seed=3, min_p=1.0).model_extra["token_ids"] == greedy
    assert complete(server, ignore_eos=True, temperature=1.5, seed=3, top_k=40).model_extra["token_ids"] != greedy


@pytest.mark.timeout(60)
def test_echo_special_tokens_and_stop_strings_in_the_text(server, tokenizer):
    # echo gives the prompt as sent, its special tokens too (skip_special_tokens is the answer's):
    # token ids all decoded, a text as it came.
    prompt = [72, 105, 256, 300]
    c = complete(server, prompt=prompt, max_tokens=4, ignore_eos=True, echo=True, logit_bias={"256": 5})
    ids = c.model_extra["token_ids"]
    assert 256 in ids and c.text == "Hi<256><300>" + tokenizer.decode(ids)
    shown = complete(server, prompt=prompt, max_tokens=4, ignore_eos=True, echo=True, logit_bias={"256": 5}, skip_special_tokens=False)
    assert shown.text == "Hi<256><300>" + tokenizer.decode(ids, skip_special_tokens=False)
    text = "<256>Hi  <300>"
    assert tokenizer.encode(text).ids[0] == 256
    assert complete(server, prompt=text, max_tokens=2, ignore_eos=True, echo=True).text.startswith(text)
    # A special token forced by logit_bias: shown only with skip_special_tokens false.
    forced = complete(server, max_tokens=2, ignore_eos=True, logit_bias={"256": 100})
    assert forced.model_extra["token_ids"] == [256, 256] and forced.text == ""
    assert complete(server, max_tokens=2, ignore_eos=True, logit_bias={"256": 100}, skip_special_tokens=False).text == "<256><256>"
    text = complete(server, ignore_eos=True).text
    stop = text[3:5]
    cut = text[: text.index(stop)]
    assert complete(server, ignore_eos=True, stop=[stop]).text == cut
    c = complete(server, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (cut + stop, "stop", stop)


@pytest.mark.timeout(60)
def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    status, r = server.post("/tokenize", {"model": MODEL, "prompt": "Hi <300> there", "return_token_strs": True})
    assert status == 200 and r["tokens"] == tokenizer.encode("Hi <300> there").ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN and r["token_strs"][3] == "<300>"
    assert server.post("/detokenize", {"model": MODEL, "tokens": r["tokens"]}) == (200, {"prompt": "Hi <300> there"})
    # Chat messages tokenize to the prompt a chat completion runs.
    messages = [{"role": "user", "content": "hi"}]
    status, r = server.post("/tokenize", {"model": MODEL, "messages": messages})
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={"return_token_ids": True})
    assert status == 200 and r["tokens"] == chat.model_extra["prompt_token_ids"]
    # A framework's tools, sent with tool_choice "none": taken by both (this template renders none).
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    status, r = server.post("/tokenize", {"model": MODEL, "messages": messages, "tools": tools})
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, tools=tools, tool_choice="none",
                                                 extra_body={"return_token_ids": True})
    assert status == 200 and r["tokens"] == chat.model_extra["prompt_token_ids"]
    # Continuing the final message: both end where its text does (the turn left open).
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, it"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    status, r = server.post("/tokenize", {"model": MODEL, "messages": messages, **options})
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={"return_token_ids": True, **options})
    assert status == 200 and r["tokens"] == chat.model_extra["prompt_token_ids"]
    assert tokenizer.decode(r["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, it"
    status, r = server.post("/tokenize", {"model": MODEL, "messages": messages, "continue_final_message": True})
    assert status == 400 and r["error"]["param"] == "continue_final_message"
    for path, body, param in [("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [1, 1000]}, "tokens"), ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
                              ("/tokenize", {"messages": messages, "prompt": "x"}, "prompt"),
                              ("/tokenize", {"messages": messages, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")]:
        status, r = server.post(path, body)
        assert 400 <= status < 500 and r["error"]["param"] == param, (path, body, r)
        # The same line a chat completion gives, never the template engine's own words.
        assert "jinja" not in r["error"]["message"].lower() and "Error" not in r["error"]["message"], r


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra,param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"min_tokens": NEW + 1}, "min_tokens"),
    ({"stop_token_ids": [5000]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_bad_or_unknown_fields_are_400_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        complete(server, **extra)
    assert err.value.response.json()["error"]["param"] == param

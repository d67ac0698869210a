"""`pocketllm serve` against the real OpenAI client, on loopback, at TP=1 and TP=2 (fp32): greedy
answers equal `pocketllm generate`'s for the same prompt, alone and under concurrent load,
completions and chat, streamed and not; every bad request is a 4xx with an OpenAI error body and
the next request succeeds; a client leaving mid-stream frees its sequence; SIGINT ends every rank
with exit 0. One server per world size serves the whole module; one more per world size in bf16
(the default dtype, where rounding would show it) answers a request alike alone, among concurrent
requests and from the prefix cache. Every server is started at once, at the module's first test."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import io
import json
import os
import re
import signal
import time
import urllib.parse

import openai
import pytest
from conftest import assert_nothing_left, generated_ids, kill_tagged, main_in_process, start, tagged

import pocketllm
from pocketllm.engine.runner import PREFILL_CHUNK
from pocketllm.serving.metrics import parse as parse_metrics

KEY = "test-key-123"
MODEL = "tiny-text"
# Long enough for a stream that is still running when a test leaves it.
MAX_LEN = 2048
NEW = 12
PROMPTS = ["Hello", "The capital of France is", "<300><301> a b c", "x"]
START_TIMEOUT_S = 60
# The KV pool: 65 blocks of the tiny model's 16 KiB at TP=1 (fewer than --max-running 4 sequences
# of MAX_LEN fill, 128); at TP=2 a block is 8 KiB and the pool those 128.
KV_GIB = 0.001
KV_BLOCKS = {1: 65, 2: 128}
GENERATION_CONFIG = {"do_sample": True, "temperature": 1.5, "top_p": 0.9}


@pytest.fixture(scope="module")
def text_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with a tokenizer that has a token for every id: the byte tokenizer plus
    `<N>` for ids 256..999, so every generated token shows up in the text being compared. It has
    no eos id, so the long requests the disconnect and shutdown tests leave run until they are
    left (tests/test_serve_engine.py covers eos). Its generation_config.json sets the sampling of
    a request that leaves it out (every test but the one for it gives its own)."""
    from tokenizers import AddedToken, Tokenizer

    out = tmp_path_factory.mktemp("tiny_text") / MODEL
    out.mkdir()
    for f in tiny_ckpt.iterdir():
        if f.name != "tokenizer.json":
            (out / f.name).symlink_to(f)
    assert json.loads((tiny_ckpt / "config.json").read_text()).get("eos_token_id") is None
    tok = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    tok.add_tokens([AddedToken(f"<{i}>", normalized=False, special=False) for i in range(256, 1000)])
    assert tok.get_vocab_size() == 1000
    tok.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return out


def generate_cli(ckpt, ids: list[int], new: int = NEW, *flags) -> tuple[list[int], str]:
    """`pocketllm generate` (TP=1, fp32, greedy unless flags say otherwise), run in this process:
    its ids and its text."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main_in_process("generate", "--ckpt", ckpt, "--dtype", "float32", "--token-ids", ",".join(map(str, ids)), "--max-new-tokens", new, *flags)
    assert rc == 0
    stdout = out.getvalue()
    # The text follows the ids line and may hold any character, line breaks too; print ends it with one.
    text = stdout.split("\n", 1)[1]
    assert stdout.startswith("generated_ids=") and text.endswith("\n")
    return generated_ids(stdout), text[:-1]


@pytest.fixture(scope="module")
def tokenizer(text_ckpt):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(text_ckpt / "tokenizer.json"))


@pytest.fixture(scope="module")
def expected(text_ckpt, tokenizer):
    """prompt text -> (generate's text, generate's ids, "length"): what the server must answer."""
    out = {}
    for p in PROMPTS:
        ids, text = generate_cli(text_ckpt, tokenizer.encode(p).ids)
        out[p] = (text, ids, "length")
    return out


class Server:
    def __init__(self, run, url: str, world: int):
        self.run, self.url, self.world = run, url, world
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=30, max_retries=0)

    def connect(self) -> http.client.HTTPConnection:
        where = urllib.parse.urlsplit(self.url)
        return http.client.HTTPConnection(where.hostname, where.port, timeout=30)

    def open(self, method: str, path: str, key: str | None = KEY, body: bytes | None = None, data=None):
        """A raw request (plain http.client, no client library in between); the open response."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if data is not None:
            body = json.dumps(data).encode()
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn = self.connect()
        conn.request(method, path, body=body, headers=headers)
        return conn, conn.getresponse()

    def http(self, method: str, path: str, key: str | None = KEY, body: bytes | None = None, data=None) -> tuple[int, str]:
        conn, r = self.open(method, path, key, body, data)
        with contextlib.closing(conn):
            return r.status, r.read().decode()

    def metrics(self) -> dict[str, float]:
        status, text = self.http("GET", "/metrics")
        assert status == 200
        return parse_metrics(text)


def start_server(text_ckpt, world: int, tmp_path, *flags):
    """`pocketllm serve` of the text checkpoint at `world` ranks, started; ready() waits for it. The
    API key is given by --api-key at one rank, by POCKETLLM_API_KEY at two (out of the process list)."""
    if world == 1:
        return start("serve", "--ckpt", text_ckpt, "--tp-world", world, "--port", 0, "--max-len", MAX_LEN, "--api-key", KEY, *flags, tmp_path=tmp_path)
    return start("serve", "--ckpt", text_ckpt, "--tp-world", world, "--port", 0, "--max-len", MAX_LEN, *flags, tmp_path=tmp_path,
                 env={"POCKETLLM_API_KEY": KEY})


def ready(run, world: int, timeout: float = START_TIMEOUT_S) -> Server:
    """The started server once it says it is serving (killed if it never does within `timeout`)."""
    try:
        run.line_time("serving ", timeout=timeout)
    except AssertionError:
        run.proc.kill()
        raise
    url = re.search(r"on (http://\S+)", run.stderr).group(1)
    return Server(run, url, world)


def stop(run) -> None:
    if run.proc.poll() is None:
        run.proc.kill()
    run.wait(timeout=15)
    assert_nothing_left(run, within=5)


def serving(text_ckpt, world: int, tmp_path, *flags, start_timeout: float = START_TIMEOUT_S):
    """A server of the text checkpoint at `world` ranks, for a module's tests; stopped after."""
    run = start_server(text_ckpt, world, tmp_path, *flags)
    yield ready(run, world, start_timeout)
    stop(run)


FP32_FLAGS = ("--dtype", "float32", "--max-running", 4, "--kv-cache-gib", KV_GIB)
BF16_FLAGS = ("--max-running", 8)


@pytest.fixture(scope="module")
def started(text_ckpt, tmp_path_factory):
    """Every server this module's tests use, started together the first time a test asks for one
    (each spends seconds of a core starting torch and loading, mostly one process at a time, so
    they overlap): fp32 and bf16 at TP=1 and TP=2, and the one whose rank 1 dies. Each is checked
    ready, and stopped, by the fixture or test that uses it; any still running at the module's end
    is killed."""
    runs = {}
    for world in (1, 2):
        runs["fp32", world] = start_server(text_ckpt, world, tmp_path_factory.mktemp(f"serve{world}"), *FP32_FLAGS)
        runs["bf16", world] = start_server(text_ckpt, world, tmp_path_factory.mktemp(f"serve-bf16-{world}"), *BF16_FLAGS)
    # (An engine failure on rank 0 itself: tests/test_serve_engine.py.)
    runs["dead-rank"] = start("serve", "--ckpt", text_ckpt, "--dtype", "float32", "--tp-world", 2, "--port", 0, "--max-len", 64,
                              tmp_path=tmp_path_factory.mktemp("serve-dead-rank"), env={"POCKETLLM_FAULT": "rank=1,at=decode,kind=kill"})
    runs["http-dies"] = start("serve", "--ckpt", text_ckpt, "--dtype", "float32", "--tp-world", 2, "--port", 0, "--max-len", 64,
                              tmp_path=tmp_path_factory.mktemp("serve-http-dies"))
    try:
        yield runs
    finally:
        for run in runs.values():
            if run.proc.poll() is None:
                run.proc.kill()
                kill_tagged(run.tag)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, started):
    world = request.param
    run = started["fp32", world]
    yield ready(run, world)
    stop(run)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def bf16_server(request, started):
    """In bf16, the default, where a request's tokens would show any dependence on its batch."""
    world = request.param
    run = started["bf16", world]
    yield ready(run, world)
    stop(run)


def completion(server, prompt, **kw):
    args = dict(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True}) | kw
    return server.client.completions.create(**args)


def streamed(server, prompt, **kw) -> tuple[str, list[int], str | None]:
    text, ids, reason = "", [], None
    for chunk in server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                                  extra_body={"return_token_ids": True}, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            ids += chunk.choices[0].model_extra["token_ids"]
            reason = chunk.choices[0].finish_reason or reason
    return text, ids, reason


@pytest.mark.timeout(90)
def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert server.client.models.retrieve(MODEL) == server.client.models.list().data[0]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.models.retrieve("org/other")
    assert server.http("GET", "/health") == (200, '{"status":"ok"}')
    assert server.http("HEAD", "/health") == (200, "")
    assert server.http("GET", "/version") == (200, json.dumps({"version": pocketllm.__version__}, separators=(",", ":")))


@pytest.mark.timeout(60)
def test_completions_equal_generate(server, expected, tokenizer):
    for prompt in PROMPTS:
        r = completion(server, prompt)
        choice = r.choices[0]
        assert (choice.text, choice.model_extra["token_ids"], choice.finish_reason) == expected[prompt], prompt
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt).ids) and r.usage.completion_tokens == len(expected[prompt][1])
    # A prompt given as token ids is the same prompt.
    assert completion(server, tokenizer.encode(PROMPTS[1]).ids).choices[0].text == expected[PROMPTS[1]][0]


@pytest.mark.timeout(60)
def test_a_sampled_completion_equals_generate_with_the_same_seed(server, text_ckpt, tokenizer):
    prompt = PROMPTS[1]
    # The sampling the checkpoint's generation_config.json sets, given here explicitly.
    temperature, top_p = GENERATION_CONFIG["temperature"], GENERATION_CONFIG["top_p"]
    ids, text = generate_cli(text_ckpt, tokenizer.encode(prompt).ids, NEW, "--temperature", temperature, "--top-p", top_p, "--seed", 7)
    greedy = completion(server, prompt).choices[0].model_extra["token_ids"]
    c = completion(server, prompt, temperature=temperature, top_p=top_p, seed=7).choices[0]
    assert (c.text, c.model_extra["token_ids"]) == (text, ids) and ids != greedy
    # Left out of a request, they are its defaults, as the server said at start.
    default = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, seed=7, extra_body={"return_token_ids": True})
    assert default.choices[0].model_extra["token_ids"] == ids
    assert "sampling defaults from generation_config.json: temperature=1.5, top_p=0.9 (a request's own fields win" in server.run.stderr


@pytest.fixture(scope="module")
def prompt_logprobs(text_ckpt, tokenizer, tmp_path_factory):
    """PROMPTS[1]'s ids, and each position's log_softmax from generate --logits-out (fp32, TP=1)."""
    import torch
    from safetensors.torch import load_file

    ids = tokenizer.encode(PROMPTS[1]).ids
    out = tmp_path_factory.mktemp("logits") / "logits.safetensors"
    generate_cli(text_ckpt, ids, 1, "--logits-out", out)
    return ids, torch.log_softmax(load_file(out)["logits"].double(), dim=-1)


@pytest.mark.timeout(60)
def test_echo_with_logprobs_scores_the_prompt_as_generates_logits_do(server, prompt_logprobs):
    # What evaluation harnesses send for a loglikelihood (echo, logprobs, max_tokens 0 or 1): each
    # prompt token's logprob under the position before it, at either TP (every rank runs the head
    # over every row), whether or not the prompt's prefix is cached.
    ids, want = prompt_logprobs
    for max_tokens in (0, 1, 1):
        r = server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=max_tokens, temperature=0, echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(PROMPTS[1]) and len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx([float(want[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4)
        assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)]) and lp.text_offset[0] == 0
        assert r.usage.completion_tokens == max_tokens and r.choices[0].finish_reason == "length"
        if max_tokens:
            assert lp.text_offset[-1] == len(PROMPTS[1])


@pytest.mark.timeout(60)
def test_streamed_completions_equal_generate(server, expected):
    for prompt in PROMPTS[:2]:
        assert streamed(server, prompt) == expected[prompt]
    chunks = list(server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == 5


@pytest.mark.timeout(90)
def test_chat_equals_generate_on_the_template_transformers_renders(server, text_ckpt):
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <300>"}]
    config = json.loads((text_ckpt / "tokenizer_config.json").read_text())
    hf = PreTrainedTokenizerFast(tokenizer_file=str(text_ckpt / "tokenizer.json"))
    prompt_ids = hf.apply_chat_template(messages, chat_template=config["chat_template"], add_generation_prompt=True, tokenize=True, return_dict=False)
    ids, text = generate_cli(text_ckpt, prompt_ids)
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt_ids) and r.choices[0].finish_reason == "length"
    pieces = [c.choices[0].delta.content or "" for c in server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NEW, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == text


@pytest.mark.timeout(90)
def test_concurrent_requests_each_equal_generate(server, expected):
    jobs = [(p, s) for p in PROMPTS for s in (False, True)]

    def one(job):
        prompt, stream = job
        if stream:
            return streamed(server, prompt)
        c = completion(server, prompt).choices[0]
        return c.text, c.model_extra["token_ids"], c.finish_reason

    # A long request running all along: every job shares its passes with it, and with the others.
    long = server.client.completions.create(model=MODEL, prompt="long", max_tokens=MAX_LEN - 8, temperature=0, stream=True)
    next(iter(long))
    running, blocks = [], []
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(one, job) for job in jobs]
        while not all(f.done() for f in futures):
            m = server.metrics()
            running.append(m["pocketllm_requests_running"])
            blocks.append(m["pocketllm_kv_cache_blocks_used"])
            assert m["pocketllm_kv_cache_blocks_total"] == KV_BLOCKS[server.world]
            time.sleep(0.01)
        results = [f.result() for f in futures]
    long.close()
    assert max(running) >= 3, running
    # Each running request holds a block at least.
    assert max(blocks) >= 3, blocks
    for (prompt, stream), got in zip(jobs, results):
        assert got == expected[prompt], (prompt, stream)
    idle = _wait_idle(server)
    assert idle["pocketllm_requests_running"] == 0 and idle["pocketllm_kv_cache_blocks_used"] == 0


@pytest.mark.timeout(90)
def test_a_follow_up_starts_from_the_cached_prefix_and_equals_generate(server, text_ckpt):
    # A chat's next turn resends the whole history: it starts from the first request's prompt
    # cached at its chunk end (the prefix cache is on by default), at TP=2 on every rank alike,
    # with generate's tokens.
    first = [(17 * i + 5) % 1000 for i in range(PREFILL_CHUNK + 80)]
    before = server.metrics()
    reply = completion(server, first).choices[0].model_extra["token_ids"]
    follow_up = first + reply + [7, 8, 9]
    ids, text = generate_cli(text_ckpt, follow_up)
    c = completion(server, follow_up).choices[0]
    assert (c.model_extra["token_ids"], c.text) == (ids, text)
    m = server.metrics()
    assert m["pocketllm_prefix_cache_hits_total"] == before["pocketllm_prefix_cache_hits_total"] + 1
    # Batch-invariant, the cache holds what a prompt's own chunks computed, not the first
    # request's decode steps: the follow-up starts at the first prompt's chunk end.
    assert m["pocketllm_prefix_cache_hit_tokens_total"] - before["pocketllm_prefix_cache_hit_tokens_total"] == PREFILL_CHUNK


@pytest.mark.timeout(120)
def test_bf16_greedy_and_seeded_text_is_the_same_alone_among_concurrent_requests_and_from_the_cache(bf16_server):
    # The case first: "Hello" alone, then eight copies at once. Then prompts of every
    # kind (text, token ids, a prompt over a chunk, seeded sampling) alone, then all at once,
    # beside the copies: prompt chunks share passes with decode steps. The long prompt's second
    # run starts from its chunk end, cached by the first: caching on against a cold run.
    server = bf16_server
    seeded = dict(temperature=1.0, top_p=0.9, seed=3)
    long = [(13 * i + 7) % 1000 for i in range(PREFILL_CHUNK + 100)]
    jobs = [("Hello", {})] * 8 + [(p, {}) for p in PROMPTS] + [(long, {}), (PROMPTS[1], seeded), (long[:PREFILL_CHUNK + 5], seeded)]

    def text(job) -> str:
        prompt, kw = job
        return completion(server, prompt, **kw).choices[0].text

    hello = text(jobs[0])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(text, jobs[:8])) == [hello] * 8
    before = server.metrics()
    alone = [text(job) for job in jobs[8:]]
    assert text((long, {})) == alone[len(PROMPTS)]
    hits = server.metrics()["pocketllm_prefix_cache_hits_total"] - before["pocketllm_prefix_cache_hits_total"]
    # The long prompt's second run and the seeded branch of it (after the first) start from the cache.
    assert hits == 2, hits
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(text, jobs))
    assert together == [hello] * 8 + alone


@pytest.mark.timeout(60)
def test_a_stop_string_ends_the_text_before_it(server, expected):
    text, _, _ = expected["Hello"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.index(stop)]
    c = completion(server, "Hello", stop=[stop, "never seen"]).choices[0]
    assert (c.text, c.finish_reason) == (cut, "stop")
    got, _, reason = streamed(server, "Hello", stop=stop)
    assert (got, reason) == (cut, "stop")


def _wait_idle(server, timeout: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["pocketllm_requests_running"] == 0 and m["pocketllm_requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_bad_requests_answer_4xx_json_and_the_next_succeeds(server, expected):
    long_prompt = [5] * MAX_LEN
    bad = {
        "unknown field": (dict(extra_body={"frobnicate": 1}), 400, "frobnicate"),
        "bad value": (dict(temperature=-1), 400, "temperature"),
        "n=65": (dict(n=65), 400, "n"),
        "prompt too long": (dict(prompt=long_prompt), 400, "prompt"),
        "max_tokens too big": (dict(max_tokens=MAX_LEN), 400, "max_tokens"),
        "token id outside the vocab": (dict(prompt=[1, 5000]), 400, "prompt"),
        "unknown model": (dict(model="gpt-4"), 404, "model"),
    }
    for name, (kw, status, param) in bad.items():
        args = dict(model=MODEL, prompt="Hello", max_tokens=NEW, temperature=0) | kw
        with pytest.raises(openai.APIStatusError) as err:
            server.client.completions.create(**args)
        assert err.value.status_code == status, name
        body = err.value.response.json()["error"]
        assert body["param"] == param and body["message"] and body["type"], (name, body)
        assert completion(server, "Hello").choices[0].text == expected["Hello"][0], f"after {name}"
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    raw = {
        "malformed JSON": server.http("POST", "/v1/completions", body=b'{"model": '),
        "not an object": server.http("POST", "/v1/completions", data=[1, 2]),
        "no API key": server.http("GET", "/v1/models", key=None),
        "wrong API key": server.http("POST", "/v1/completions", key="nope", data={"model": MODEL, "prompt": "x"}),
        "no such path": server.http("GET", "/v2/nothing"),
    }
    for name, (status, text) in raw.items():
        assert 400 <= status < 500 and set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, (name, text)
    assert raw["no API key"][0] == 401 and raw["wrong API key"][0] == 401
    # A path's wrong method: 405 naming the ones it takes, in the Allow header HTTP asks for.
    conn, r = server.open("GET", "/v1/completions")
    with contextlib.closing(conn):
        assert r.status == 405 and r.getheader("Allow") == "POST" and set(json.loads(r.read())["error"]) == {"message", "type", "param", "code"}
    # The scheme's name is case-insensitive (RFC 7235).
    conn = server.connect()
    with contextlib.closing(conn):
        conn.request("GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})
        assert conn.getresponse().status == 200
    assert completion(server, "Hello").choices[0].text == expected["Hello"][0]
    assert _wait_idle(server)["pocketllm_requests_running"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2], ids=["one-choice", "two-choices"])
def test_a_client_leaving_mid_stream_frees_its_sequence(server, n):
    before = server.metrics()
    new = MAX_LEN - 8
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": new, "temperature": 0, "stream": True, "n": n}
    conn, r = server.open("POST", "/v1/completions", data=body)
    with contextlib.closing(conn):
        assert r.status == 200
        events = 0
        while events < 3 * n:
            events += r.readline().startswith(b"data: ")
        assert server.metrics()["pocketllm_requests_running"] == n
    m = _wait_idle(server)
    assert m["pocketllm_requests_running"] == 0
    cancelled = 'pocketllm_requests_ended_total{how="cancelled"}'
    assert m[cancelled] == before.get(cancelled, 0) + n
    # Freed early, not run to its end.
    assert m["pocketllm_generation_tokens_total"] - before["pocketllm_generation_tokens_total"] < new


@pytest.mark.timeout(60)
def test_a_client_leaving_before_a_whole_answer_frees_its_sequences(server):
    # Two prompts: both sequences are ended.
    before = server.metrics()
    new = MAX_LEN - 8
    conn = server.connect()
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": ["Hello", "Hi"], "max_tokens": new, "temperature": 0}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while server.metrics()["pocketllm_requests_running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    conn.close()
    m = _wait_idle(server)
    cancelled = 'pocketllm_requests_ended_total{how="cancelled"}'
    assert m["pocketllm_requests_running"] == 0 and m[cancelled] == before.get(cancelled, 0) + 2
    assert m["pocketllm_generation_tokens_total"] - before["pocketllm_generation_tokens_total"] < 2 * new


@pytest.mark.timeout(60)
def test_sigint_ends_every_rank_with_exit_0_and_the_open_stream_with_an_error(server):
    # Two choices at TP=2 (their pieces interleaved end on the first error), one at TP=1.
    stream = server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=MAX_LEN - 8, temperature=0, stream=True, n=server.world)
    next(iter(stream))
    sent = time.monotonic()
    server.run.proc.send_signal(signal.SIGINT)
    error = None
    try:
        for _ in stream:
            pass
    except openai.APIError as exc:
        error = exc
    rc = server.run.wait(timeout=10)
    took = time.monotonic() - sent
    assert rc == 0 and took < 10, (rc, took, server.run.stderr)
    # Cancelled by the shutdown, the stream ends with an error event, not silently.
    assert error is not None and "shut down" in str(error), (error, took, server.run.stderr)
    assert_nothing_left(server.run, within=1)
    assert "server stopped" in server.run.stderr


@pytest.mark.timeout(90)
def test_a_dead_rank_ends_the_server_with_the_launchers_line(started):
    run = started["dead-rank"]
    run.line_time("serving ", timeout=START_TIMEOUT_S)
    url = re.search(r"on (http://\S+)", run.stderr).group(1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=20, max_retries=0)
    # The request in flight ends with an error, never with silence: a 500 when rank 0 could still
    # answer, the connection closed when the launcher stopped it first.
    with pytest.raises((openai.InternalServerError, openai.APIConnectionError)):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
    assert run.wait(timeout=20) == 1
    assert re.search(r"rank 1 failed \(killed by signal SIGKILL\)", run.last_line), run.stderr
    assert_nothing_left(run, within=2)


@pytest.mark.timeout(90)
def test_a_dead_http_process_ends_the_server_with_one_line_as_at_tp1(started):
    """The HTTP process killed under a TP=2 server: the ranks end, and the launcher's one line is
    the one serve prints at TP=1 (not that line and then a second naming rank 0's exit code)."""
    run = started["http-dies"]
    run.line_time("serving ", timeout=START_TIMEOUT_S)
    http = [pid for pid in tagged(run.tag) if b"pocketllm.serving.http_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(http) == 1, http
    os.kill(http[0], signal.SIGKILL)
    assert run.wait(timeout=20) == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == ["pocketllm: error: the HTTP process ended before the server was stopped (exit status -9)"], run.stderr
    assert_nothing_left(run, within=2)


@pytest.mark.timeout(60)
def test_a_stop_while_the_ranks_start_is_a_stop_not_a_rank_failure(text_ckpt, tmp_path):
    """SIGTERM to the launcher while its ranks still start: rank 0, passed the signal before serve
    takes it as a stop, ends of it; the launcher says it stopped the run (128 + SIGTERM), not that
    rank 0 failed (exit 1, a failure under a service manager)."""
    run = start("serve", "--ckpt", text_ckpt, "--tp-world", 2, "--port", 0, tmp_path=tmp_path)
    deadline = time.monotonic() + 30
    while len(tagged(run.tag)) < 3:  # the launcher and its two ranks
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr
        time.sleep(0.01)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 128 + signal.SIGTERM, run.stderr
    assert run.last_line == "pocketllm: error: got SIGTERM; stopped every rank" and "failed" not in run.stderr, run.stderr
    assert_nothing_left(run, within=2)

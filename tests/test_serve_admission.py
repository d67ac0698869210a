"""No request stalls the others on its way in (`pocketllm serve`, TP=1, on loopback): a body over
the bound that --max-len and the longest token set is a 413 at once, a small request sent beside
it answered as fast as alone; a prompt too long in bytes a 400 without being tokenized; a prompt
over --max-len in tokens still the one-line 400; and a long tokenization (a /tokenize of a body
near the bound) runs beside the event loop, so a small request sent while it runs is answered
before it ends. Then the bound itself, per kind of tokenizer; and bodies that hold no text (a lone
surrogate escape) or nest past the parser, each a 400, with a body cut short leaving no traceback."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
from test_serve import KEY, MODEL, serving, text_ckpt  # noqa: F401  (text_ckpt: a fixture used here)

from pocketllm.serving.admission import Admission

# Large enough that a body near the bound takes seconds to tokenize, so that a small request held
# behind it would show; the tiny model's own limit.
MAX_LEN = 32768
# The oversized prompt.
HUGE_BYTES = 50 * 2**20
# What a small request may take beside another beyond its time alone (the target).
BESIDE_S = 2.0
# What refusing a body over the bound may take, its sending over loopback included.
REFUSED_S = 10.0


@pytest.fixture(scope="module")
def server(text_ckpt, tmp_path_factory):  # noqa: F811
    # serving's own --max-len comes first; this one, later on the command line, is the one taken.
    yield from serving(text_ckpt, 1, tmp_path_factory.mktemp("admission"), "--dtype", "float32", "--max-running", 2,
                       "--max-len", MAX_LEN)


@pytest.fixture(scope="module")
def admission(text_ckpt):  # noqa: F811
    from tokenizers import Tokenizer

    return Admission.of(Tokenizer.from_file(str(text_ckpt / "tokenizer.json")), MAX_LEN)


def small(server) -> float:
    """A two-token greedy completion's time, checked."""
    t = time.monotonic()
    status, text = server.http("POST", "/v1/completions", data={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2, text
    return time.monotonic() - t


def alone(server) -> float:
    small(server)
    return min(small(server) for _ in range(3))


def timed(fn, *args, **kw):
    t = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t, time.monotonic()


def error(text: str) -> dict:
    body = json.loads(text)["error"]
    assert set(body) == {"message", "type", "param", "code"} and "\n" not in body["message"], body
    return body


@pytest.mark.timeout(120)
def test_a_body_over_the_bound_is_413_at_once_and_a_small_request_beside_it_is_not_held(server, admission):
    base = alone(server)
    huge = json.dumps({"model": MODEL, "prompt": "hello world " * (HUGE_BYTES // 12)}).encode()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refused = pool.submit(timed, server.http, "POST", "/v1/completions", body=huge)
        beside = pool.submit(small, server)
        (status, text), took, _ = refused.result()
        small_took = beside.result()
    body = error(text)
    assert status == 413 and body["code"] == "request_too_large" and body["type"] == "invalid_request_error"
    assert f"{len(huge)} bytes" in body["message"] and f"limit of {admission.body_limit} bytes" in body["message"], body
    assert took < REFUSED_S and small_took <= base + BESIDE_S, (took, small_took, base)
    # Sent in chunks, with no length ahead: refused once the bound is passed.
    conn = server.connect()
    chunks = (huge[i:i + 2**20] for i in range(0, len(huge), 2**20))
    conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    r = conn.getresponse()
    assert r.status == 413 and f"limit of {admission.body_limit} bytes" in error(r.read().decode())["message"]
    conn.close()
    small(server)


@pytest.mark.timeout(60)
def test_a_prompt_too_long_in_bytes_is_400_without_tokenizing(server, admission):
    room = (MAX_LEN - 1) * admission.token_bytes
    for path, data, param in [("/v1/completions", {"model": MODEL, "prompt": "x" * (room + 1)}, "prompt"),
                              ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * room}]}, "messages")]:
        status, text = server.http("POST", path, data=data)
        body = error(text)
        # The message counts bytes, not tokens: the text was never tokenized.
        assert status == 400 and body["param"] == param and body["code"] == "context_length_exceeded", body
        assert "bytes of text" in body["message"] and f"context is {MAX_LEN} (--max-len)" in body["message"], body
    small(server)


@pytest.mark.timeout(60)
def test_a_prompt_over_max_len_in_tokens_is_still_the_one_line_400(server):
    for path, data, param in [("/v1/completions", {"model": MODEL, "prompt": "x" * MAX_LEN}, "prompt"),
                              ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_LEN}]}, "messages")]:
        status, text = server.http("POST", path, data=data)
        body = error(text)
        assert status == 400 and body["param"] == param and body["code"] == "context_length_exceeded", body
        assert body["message"].startswith("the prompt is ") and " tokens, and this server's context is " in body["message"], body
    small(server)


@pytest.mark.timeout(90)
def test_a_small_request_is_answered_while_a_long_tokenization_runs(server, admission):
    base = alone(server)
    # The longest text a /tokenize body within the bound holds (/tokenize counts any length).
    text = "hello world " * ((admission.body_limit - 1000) // 12)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(timed, server.http, "POST", "/tokenize", data={"prompt": text})
        # Long enough for the server to have the body and be tokenizing it.
        time.sleep(0.3)
        beside = pool.submit(timed, small, server)
        (status, answer), long_took, long_end = long.result()
        small_took, _, small_end = beside.result()
    assert status == 200 and json.loads(answer)["count"] == len(text), answer[:200]
    # Ended first though sent after: not held behind the tokenizing (no wall-clock bound needed).
    assert small_end < long_end, (small_took, base, long_took)


def _byte_level(**parts):
    """make-checkpoint's byte-level tokenizer, with parts replaced (normalizer, pre_tokenizer, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from pocketllm.byte_level import byte_symbols

    tok = Tokenizer(models.BPE(vocab={sym: b for b, sym in byte_symbols().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for name, part in parts.items():
        setattr(tok, name, part)
    return tok


@pytest.mark.timeout(30)
def test_the_bytes_a_token_stands_for_bound_every_text_or_are_unknown():
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    from pocketllm.serving.token_bytes import MAX_CHAR_BYTES, UNICODE_FOLD, token_bytes

    plain = _byte_level()
    assert token_bytes(plain) == MAX_CHAR_BYTES
    plain.add_tokens([AddedToken("<a-long-added-token>", normalized=False)])
    assert token_bytes(plain) == len("<a-long-added-token>")
    nfkc = _byte_level(normalizer=normalizers.NFKC())
    assert token_bytes(nfkc) == MAX_CHAR_BYTES * UNICODE_FOLD
    texts = ["plain text", "\U0001d7ce" * 50, "e\u0301" * 40, "\u1100\u1161\u11a8" * 30, "\u212a" * 20, "\u0390" * 10]
    for tok in (plain, nfkc):
        for text in texts:
            assert len(text.encode()) <= len(tok.encode(text).ids) * token_bytes(tok), (text, tok.normalizer)
    # Text that can vanish: no bound.
    assert token_bytes(_byte_level(normalizer=normalizers.Strip())) is None
    assert token_bytes(_byte_level(pre_tokenizer=pre_tokenizers.Whitespace())) is None
    swallowing = _byte_level()
    swallowing.add_special_tokens([AddedToken("<s>", lstrip=True)])
    assert token_bytes(swallowing) is None
    assert token_bytes(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None
    # An unknown byte length that the bound covers: each unknown character is one unk token.
    unk = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=False))
    assert len("\U0001f600\U0001f600".encode()) <= len(unk.encode("\U0001f600\U0001f600").ids) * token_bytes(unk)
    assert token_bytes(Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))) is None
    assert Admission(8, None).body_limit is None


@pytest.mark.timeout(60)
def test_bodies_no_text_or_parser_takes_are_400_and_a_body_cut_short_leaves_no_traceback(server):
    """A lone surrogate escape (in a value or a key), JSON nested past what the parser reads, and a
    sampling row whose softmax overflows are each one request's matter: 400s, then a 200, and the
    server answers on; a client gone in the middle of its body leaves no traceback."""
    deep = b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    cases = [
        ("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b"}', "surrogate (\\ud800)"),
        ("/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate (\\udfff)"),
        ("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "\\ud800": 1}', "surrogate"),
        ("/tokenize", b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}', "surrogate"),
        # An upper-case escape, and a surrogate's own UTF-8 bytes (which json reads as one).
        ("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\uDBFFb"}', "surrogate (\\udbff)"),
        ("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "a\xed\xb0\x80b"}', "surrogate (\\udc00)"),
        ("/v1/completions", deep, "nests deeper"),
    ]
    for path, body, fragment in cases:
        status, text = server.http("POST", path, body=body)
        assert status == 400 and fragment in error(text)["message"], (path, status, text)
    for overflow in ({"temperature": 1e-45}, {"temperature": 1.0, "repetition_penalty": 1e-300}):
        status, text = server.http("POST", "/v1/completions", data={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "seed": 1, **overflow})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, (overflow, text)
    conn = server.connect()
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"), ("Content-Length", "1000")):
        conn.putheader(name, value)
    conn.endheaders(b'{"model": ')
    conn.close()
    small(server)
    time.sleep(0.5)
    assert "Traceback" not in server.run.stderr, server.run.stderr

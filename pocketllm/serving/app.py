"""The HTTP routes: /v1/completions, /v1/chat/completions (where the checkpoint has a chat
template), /v1/models, /tokenize and /detokenize, /health, /version and /metrics, with --api-key checked on
every request and every error, the framework's own included (a bad path, a bad method, a body
that is not JSON), answered with an OpenAI-style JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pocketllm import __version__
from pocketllm.serving.admission import Admission, encode, off_loop
from pocketllm.serving.chat_template import ChatTemplate
from pocketllm.serving.engine_client import EngineClient
from pocketllm.serving.errors import ApiError, bad, error_body
from pocketllm.serving.generation import Piece, Usage, interleaved, pieces
from pocketllm.serving.logprobs import Names, TokenBytes, chat_logprobs, completion_logprobs, completion_prompt_logprobs, prompt_offsets
from pocketllm.serving.protocol import Generation, Limits, parse_chat, parse_completion
from pocketllm.serving.reasoning import ReasoningStream, opens_reasoning, split_reasoning
from pocketllm.serving.streaming import EventStream
from pocketllm.serving.text import OutputText
from pocketllm.serving.tokenize import detokenize, tokenize
from pocketllm.serving.tool_calls import ToolCallStream, split_tool_calls

# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.25


@dataclass
class Served:
    """What the routes serve: the model, its tokenizer and template, and the link to the engine."""

    limits: Limits
    tokenizer: object
    chat_template: ChatTemplate | None
    eos_ids: tuple[int, ...]
    engine: EngineClient
    api_key: str | None = None
    created: int = 0
    # Origins whose web pages may call this server (CORS): () none, ("*",) any.
    allowed_origins: tuple[str, ...] = ()


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="pocketllm", docs_url=None, redoc_url=None, openapi_url=None)
    admission = Admission.of(served.tokenizer, served.limits.max_len)
    token_bytes = TokenBytes(served.tokenizer)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        # Its headers too: a 405's Allow names the methods the path takes.
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    if served.api_key is not None:
        app.add_middleware(ApiKeyCheck, key=served.api_key)
    if served.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so outermost: a browser's preflight (OPTIONS, which carries no key) is
        # answered before the key check, and a refusal carries the headers its page needs to read it.
        app.add_middleware(CORSMiddleware, allow_origins=list(served.allowed_origins), allow_methods=["*"], allow_headers=["*"])

    # HEAD too: load balancers and container health checks probe with it.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if served.engine.failure is not None or served.engine.stopping:
            raise ApiError(503, "the server is stopping")
        return {"status": "ok"}

    def card() -> dict:
        # root and parent as vLLM lists them: load generators read root.
        return {"id": served.limits.model, "object": "model", "created": served.created, "owned_by": "pocketllm",
                "root": served.limits.model, "parent": None, "max_model_len": served.limits.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    # OpenAI's retrieve (the client's models.retrieve); the name may hold slashes (org/model).
    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != served.limits.model:
            raise ApiError(404, f"the model {model!r} does not exist: this server serves {served.limits.model!r}", "model", "model_not_found")
        return card()

    # vLLM's: tools that speak to either server ask it.
    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        text = served.engine.render_metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request, admission)
        encoder = _encoder(served.tokenizer, functools.partial(admission.check_text, param="prompt"))
        gens = await off_loop(parse_completion, body, served.limits, encoder)
        return await _answer(served, request, gens, "cmpl", [CompletionShape(served.tokenizer, g) for g in gens])

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        if served.chat_template is None:
            raise ApiError(404, "this model has no chat template (tokenizer_config.json's chat_template): use /v1/completions", code="no_chat_template")
        body = await _json(request, admission)
        renderer = _renderer(served, functools.partial(admission.check_text, param="messages"))
        gens = await off_loop(parse_chat, body, served.limits, renderer)
        return await _answer(served, request, gens, "chatcmpl", [ChatShape(served.tokenizer, g, token_bytes) for g in gens])

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        render = _renderer(served) if served.chat_template is not None else None
        return await off_loop(_respond, tokenize, await _json(request, admission), served.limits, served.tokenizer, render)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await off_loop(_respond, detokenize, await _json(request, admission), served.limits, served.tokenizer)

    return app


class ApiKeyCheck:
    """Every request must carry 'Authorization: Bearer KEY', else a 401. Plain ASGI rather than
    FastAPI's http middleware, which would pass every streamed chunk through a memory stream."""

    def __init__(self, app, key: str):
        self.app, self._expected = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        # The scheme's name is case-insensitive (RFC 7235): "bearer KEY" is as good.
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected):
            return await self.app(scope, receive, send)
        what = "the API key is wrong" if given else "no API key given"
        body = error_body(401, f"{what}: send the header 'Authorization: Bearer KEY' with this server's --api-key", code="invalid_api_key")
        await JSONResponse(body, status_code=401)(scope, receive, send)


async def _json(request: Request, admission: Admission):
    """The body parsed; one over the admission's limit is refused as soon as that is known: from
    its Content-Length, or once as much has arrived (the server discards the rest as it comes)."""
    limit = admission.body_limit
    declared = request.headers.get("content-length", "")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise admission.too_large(int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if limit is not None and size > limit:
                raise admission.too_large(None)
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody is left to read an answer; an error ends the request without a traceback.
        raise bad("the client went away before its request body ended") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the request body is not valid JSON here: it nests deeper than this server reads") from None
    # A lone surrogate comes only from an escape of one or (json reads bytes with surrogatepass) its
    # raw UTF-8 bytes: a body with neither is not walked, which for a prompt of 100k token ids would
    # cost the event loop some 20 ms, three times the parse.
    if json.detect_encoding(raw) != "utf-8" or _MAY_HOLD_A_SURROGATE.search(raw):
        _check_unicode(body)
    return body


_MAY_HOLD_A_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _check_unicode(body) -> None:
    """JSON may escape half of a UTF-16 surrogate pair alone (\\ud800), which no text is: a
    string or key holding one is refused here, before a tokenizer or an error message meets it."""
    stack = [body]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise bad(f"the request body holds a lone UTF-16 surrogate (\\u{ord(v[exc.start]):04x}), which is no character") from None


def _respond(route, *args) -> JSONResponse:
    """route(*args)'s answer as JSON, written where it is computed: the ids of a long text take a
    while to write, which the event loop would otherwise spend."""
    return JSONResponse(route(*args))


def _encoder(tokenizer, check=None):
    """encode(text, add_special_tokens) for the request parsers, called in a worker thread;
    check(text) first refuses a text too long to fit."""

    def encoder(text: str, add_special_tokens: bool, empty_ok: bool = False) -> list[int]:
        if check is not None:
            check(text)
        ids = encode(tokenizer, text, add_special_tokens)
        if not ids and not empty_ok:
            raise bad("the prompt encodes to no tokens", "prompt")
        return ids

    return encoder


def _renderer(served: Served, check=None):
    """The chat template applied and its text encoded, as _encoder; check(text) sees the rendered text."""

    def render(messages, add_generation_prompt: bool, continue_final: bool, template_kwargs: dict, add_special_tokens: bool,
               tools: list[dict] | None = None) -> list[int]:
        text = served.chat_template.render(messages, add_generation_prompt, template_kwargs, continue_final, tools)
        return _encoder(served.tokenizer, check)(text, add_special_tokens, empty_ok=True)

    return render


async def _answer(served: Served, request: Request, gens: list[Generation], kind: str, shapes: list):
    """One sequence per choice (gens, and their shapes, in choice order), their pieces as they
    come; the request's usage counts each prompt once, as vLLM's does."""
    seqs = []
    try:
        for g in gens:
            seqs.append(served.engine.submit(g.prompt, g.max_tokens, g.sampling, served.eos_ids))
    except BaseException:
        for seq in seqs:
            seq.cancel()
        raise

    def cancel() -> None:
        for seq in seqs:
            seq.cancel()

    gen = gens[0]
    usage = Usage(sum(len(g.prompt) for g in gens[:: gen.n]))
    head = {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.limits.model}
    parts = interleaved([pieces(seq, OutputText(served.tokenizer, g.stop, g.skip_special_tokens, g.include_stop, g.sampling.min_tokens, g.prompt),
                                usage, g.include_stop) for seq, g in zip(seqs, gens, strict=True)])
    if gen.stream:
        return EventStream(_chunks(parts, head, shapes, gen, usage), cancel)
    collected: list[list[Piece]] = [[] for _ in gens]

    async def collect():
        async for i, piece in parts:
            collected[i].append(piece)

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ApiError(400, "the client disconnected")
        task.result()
    finally:
        cancel()
        await parts.aclose()
    choices = []
    for g, shape, got in zip(gens, shapes, collected, strict=True):
        whole = Piece("".join(p.text for p in got), [t for p in got for t in p.token_ids], got[-1].finish_reason,
                      [lp for p in got for lp in p.logprobs], got[-1].stop_reason, [o for p in got for o in p.text_offsets],
                      got[0].prompt_logprobs)
        choice = shape.body(whole)
        if g.return_token_ids:
            # Each choice's prompt too where a completion has several, as vLLM's choices carry it.
            choice.update({"token_ids": whole.token_ids, **({"prompt_token_ids": g.prompt} if gen.n < len(gens) else {})})
        choices.append(choice)
    extra = {"prompt_token_ids": gen.prompt} if gen.return_token_ids and gen.n == len(gens) else {}
    return {**head, "object": shapes[0].object, "choices": choices, "usage": usage.body(), **extra}


async def _chunks(parts, head: dict, shapes: list, gen: Generation, usage: Usage):
    try:
        async for i, piece in parts:
            choice = shapes[i].chunk(piece)
            if gen.return_token_ids:
                choice["token_ids"] = piece.token_ids
            # With include_usage, every chunk carries usage: null and one last chunk carries it, as OpenAI streams it
            # (the usage so far, with vLLM's continuous_usage_stats).
            extra = {"usage": usage.body() if gen.continuous_usage else None} if gen.include_usage else {}
            yield {**head, "object": shapes[i].chunk_object, "choices": [choice], **extra}
    finally:
        # Closed with the stream (a client gone): the choices' pieces now, not when collected.
        await parts.aclose()
    if gen.include_usage:
        yield {**head, "object": shapes[0].chunk_object, "choices": [], "usage": usage.body()}


class CompletionShape:
    """A /v1/completions choice, whole or as chunks: the text (after the prompt's, with echo), its
    logprobs with each token's offset into that text (with echo, the prompt's tokens' first, on
    the first chunk), and how it finished."""

    object = chunk_object = "text_completion"

    def __init__(self, tokenizer, gen: Generation):
        self.tokenizer, self.gen = tokenizer, gen
        self.prefix = ""
        if gen.echo:
            # The prompt as sent (its special tokens too); token ids, all of them decoded.
            self.prefix = gen.prompt_text if gen.prompt_text is not None else tokenizer.decode(gen.prompt, skip_special_tokens=False)
        self.shift = len(self.prefix)  # where the new tokens' text begins in the choice's

    def chunk(self, piece: Piece) -> dict:
        text, self.prefix = self.prefix + piece.text, ""
        return self._choice(text, piece)

    def body(self, piece: Piece) -> dict:
        return self._choice(self.prefix + piece.text, piece)

    def _choice(self, text: str, piece: Piece) -> dict:
        logprobs = None
        if self.gen.sampling.logprobs is not None:
            name = Names(self.tokenizer, self.gen.tokens_as_ids)
            logprobs = completion_logprobs(name, piece.logprobs, [o + self.shift for o in piece.text_offsets])
            if piece.prompt_logprobs is not None:
                offsets = prompt_offsets(self.tokenizer, self.gen.prompt, self.gen.prompt_text)
                ahead = completion_prompt_logprobs(name, self.gen.prompt, piece.prompt_logprobs, offsets)
                logprobs = {k: ahead[k] + logprobs[k] for k in logprobs}
        return {"index": self.gen.index, "text": text, "logprobs": logprobs, "finish_reason": piece.finish_reason, "stop_reason": piece.stop_reason}


# A chat prompt's last tokens, decoded, hold its generation prompt (whether it opened a reasoning block).
PROMPT_TAIL_TOKENS = 32


class ChatShape:
    """A /v1/chat/completions choice, whole (a message) or as chunks (deltas, the role on the
    first). With serve --reasoning-parser, the answer's reasoning comes apart from its content
    (reasoning.py). With tools to read (tool_choice "auto"), the model's tool calls come out of
    its content as the message's tool_calls, finishing as "tool_calls"; streamed, the text from a
    call's opening tag on waits for the end, whose chunk carries the calls whole."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, gen: Generation, token_bytes: TokenBytes):
        self.tokenizer, self.gen, self.token_bytes = tokenizer, gen, token_bytes
        self.first = True
        self.calls = ToolCallStream(gen.tools, gen.first_tool_only) if gen.tools else None
        self.opens_reasoning = gen.reasoning and opens_reasoning(tokenizer.decode(gen.prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
        self.thinking = ReasoningStream(self.opens_reasoning) if gen.reasoning else None

    def chunk(self, piece: Piece) -> dict:
        text, calls, finish, reasoning = piece.text, [], piece.finish_reason, ""
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(piece.text)
            if finish is not None:
                more, rest = self.thinking.finish()
                reasoning, text = reasoning + more, text + rest
        if self.calls is not None:
            text = self.calls.feed(text)
            if finish is not None:
                rest, calls = self.calls.finish()
                text += rest
        if self.first:
            delta = {"role": "assistant", "content": text}
        else:
            delta = {"content": text} if text or not (finish or reasoning) else {}
        if reasoning:
            delta.update(reasoning=reasoning, reasoning_content=reasoning)
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish = "tool_calls"
        self.first = False
        return {"index": self.gen.index, "delta": delta, "logprobs": self._logprobs(piece), "finish_reason": finish,
                "stop_reason": piece.stop_reason}

    def body(self, piece: Piece) -> dict:
        reasoning, content, calls = None, piece.text, []
        if self.gen.reasoning:
            reasoning, content = split_reasoning(piece.text, self.opens_reasoning)
        if self.gen.tools:
            content, calls = split_tool_calls(content, self.gen.tools, self.gen.first_tool_only)
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        if reasoning is not None:
            message.update(reasoning=reasoning, reasoning_content=reasoning)
        return {"index": self.gen.index, "message": message, "logprobs": self._logprobs(piece),
                "finish_reason": "tool_calls" if calls else piece.finish_reason, "stop_reason": piece.stop_reason}

    def _logprobs(self, piece: Piece) -> dict | None:
        if self.gen.sampling.logprobs is None:
            return None
        return chat_logprobs(Names(self.tokenizer, self.gen.tokens_as_ids, self.token_bytes), piece.logprobs)

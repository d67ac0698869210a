"""The HTTP routes: /v1/completions, /v1/chat/completions (where the checkpoint has a chat
template), /v1/models, /health and /metrics, with --api-key checked on every request and every
error, the framework's own included (a bad path, a bad method, a body that is not JSON), answered
with an OpenAI-style JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pocketllm.serving.chat_template import ChatTemplate
from pocketllm.serving.engine_loop import EngineLoop
from pocketllm.serving.errors import ApiError, bad, error_body
from pocketllm.serving.generation import Piece, Usage, pieces
from pocketllm.serving.protocol import Generation, Limits, parse_chat, parse_completion
from pocketllm.serving.streaming import EventStream
from pocketllm.serving.text import OutputText

# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.25


@dataclass
class Served:
    """What the routes serve: the model, its tokenizer and template, and the engine loop."""

    limits: Limits
    tokenizer: object
    chat_template: ChatTemplate | None
    eos_ids: tuple[int, ...]
    engine: EngineLoop
    api_key: str | None = None
    created: int = 0


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="pocketllm", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    if served.api_key is not None:
        app.add_middleware(ApiKeyCheck, key=served.api_key)

    @app.get("/health")
    async def health():
        if served.engine.failure is not None or served.engine.stopping:
            raise ApiError(503, "the server is stopping")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": served.limits.model, "object": "model", "created": served.created, "owned_by": "pocketllm",
                "max_model_len": served.limits.max_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        scheduler = served.engine.scheduler
        text = served.engine.metrics.render(scheduler.num_running, scheduler.num_waiting)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        gen = parse_completion(body, served.limits, _encoder(served.tokenizer))
        return await _answer(served, request, gen, "cmpl", _completion_chunk, _completion_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        template = served.chat_template
        if template is None:
            raise ApiError(404, "this model has no chat template (tokenizer_config.json's chat_template): use /v1/completions", code="no_chat_template")
        body = await _json(request)

        def render(messages):
            return _encoder(served.tokenizer)(template.render(messages), empty_ok=True)

        gen = parse_chat(body, served.limits, render)
        return await _answer(served, request, gen, "chatcmpl", _chat_chunk, _chat_body)

    return app


class ApiKeyCheck:
    """Every request must carry 'Authorization: Bearer KEY', else a 401. Plain ASGI rather than
    FastAPI's http middleware, which would pass every streamed chunk through a memory stream."""

    def __init__(self, app, key: str):
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        what = "the API key is wrong" if given else "no API key given"
        body = error_body(401, f"{what}: send the header 'Authorization: Bearer KEY' with this server's --api-key", code="invalid_api_key")
        await JSONResponse(body, status_code=401)(scope, receive, send)


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None


def _encoder(tokenizer):
    def encode(text: str, empty_ok: bool = False) -> list[int]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if not ids and not empty_ok:
            raise bad("the prompt encodes to no tokens", "prompt")
        return ids

    return encode


async def _answer(served: Served, request: Request, gen: Generation, kind: str, chunk_of, body_of):
    seq = served.engine.submit(gen.prompt, gen.max_tokens, gen.sampling, served.eos_ids)
    usage = Usage(len(gen.prompt))
    text = OutputText(served.tokenizer, gen.stop)
    head = {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.limits.model}
    parts = pieces(seq, text, served.eos_ids, usage)
    if gen.stream:
        return EventStream(_chunks(parts, head, chunk_of, gen, usage), seq.cancel)
    collected: list[Piece] = []

    async def collect():
        async for piece in parts:
            collected.append(piece)

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
        seq.cancel()
        await parts.aclose()
    text_out = "".join(p.text for p in collected)
    ids = [t for p in collected for t in p.token_ids]
    choice = body_of(text_out, collected[-1].finish_reason)
    if gen.return_token_ids:
        choice["token_ids"] = ids
    extra = {"prompt_token_ids": gen.prompt} if gen.return_token_ids else {}
    return {**head, "object": "chat.completion" if kind == "chatcmpl" else "text_completion", "choices": [choice],
            "usage": usage.body(), **extra}


async def _chunks(parts, head: dict, chunk_of, gen: Generation, usage: Usage):
    obj = "chat.completion.chunk" if chunk_of is _chat_chunk else "text_completion"
    first = True
    async for piece in parts:
        choice = chunk_of(piece, first)
        first = False
        if gen.return_token_ids:
            choice["token_ids"] = piece.token_ids
        # With include_usage, every chunk carries usage: null and one last chunk carries it, as OpenAI streams it.
        extra = {"usage": None} if gen.include_usage else {}
        yield {**head, "object": obj, "choices": [choice], **extra}
    if gen.include_usage:
        yield {**head, "object": obj, "choices": [], "usage": usage.body()}


def _completion_chunk(piece: Piece, _first: bool) -> dict:
    return {"index": 0, "text": piece.text, "logprobs": None, "finish_reason": piece.finish_reason}


def _completion_body(text: str, finish_reason: str) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _chat_chunk(piece: Piece, first: bool) -> dict:
    delta = {"role": "assistant", "content": piece.text} if first else ({"content": piece.text} if piece.text or not piece.finish_reason else {})
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}


def _chat_body(text: str, finish_reason: str) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}

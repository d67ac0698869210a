"""Server-sent events as OpenAI streams them: one `data: {json}` event per chunk, `data: [DONE]` at
the end, and an error that ends a stream after it began sent as a `data: {"error": ...}` event
(the status line is gone by then). The response cancels its request however it ends, so a client
that disconnects mid-stream frees its slot at the next step."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from pocketllm.serving.errors import ApiError


def sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


async def events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except ApiError as exc:
        yield sse(exc.body())
    yield DONE


class EventStream(StreamingResponse):
    """A text/event-stream response that runs on_close once it ends, sent in full or not."""

    def __init__(self, chunks: AsyncIterator[dict], on_close):
        super().__init__(events(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._chunks, self._on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            # Close the generator now rather than when it is collected, so that its cleanup (the
            # request's cancel) never waits on the garbage collector.
            with contextlib.suppress(RuntimeError):
                await self.body_iterator.aclose()
                await self._chunks.aclose()

"""One request's answer as it is made: its tokens from the engine turned into text pieces, a stop
string ending it early (the request is cancelled, so its slot frees at the next step), and the
finish reason and usage at the end. Both endpoints, streamed or not, are built on this."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pocketllm.serving.engine_loop import Sequence
from pocketllm.serving.errors import ApiError
from pocketllm.serving.text import OutputText


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)  # tokens that arrived with this piece
    finish_reason: str | None = None  # on the last piece: "stop" or "length"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


async def pieces(seq: Sequence, text: OutputText, eos_ids: tuple[int, ...], usage: Usage) -> AsyncIterator[Piece]:
    """The answer's pieces, the last one with its finish reason. Raises ApiError when the request
    ends without finishing (the server shut down, the engine failed). Leaving early (a client gone)
    cancels the request."""
    try:
        while True:
            event = await seq.next()
            if event.error is not None:
                raise event.error
            tokens = []
            chunk = ""
            if event.token is not None:
                usage.completion_tokens += 1
                tokens.append(event.token)
                # An eos id ends the answer and is no part of its text.
                if event.token not in eos_ids:
                    chunk = text.add(event.token)
            if text.stopped:
                seq.cancel()
                yield Piece(chunk, tokens, "stop")
                return
            if event.finish_reason == "cancelled":
                raise ApiError(503, "the server shut down before this request finished")
            if event.finish_reason is not None:
                yield Piece(chunk + text.finish(), tokens, "stop" if text.stopped else event.finish_reason)
                return
            if chunk or tokens:
                yield Piece(chunk, tokens)
    finally:
        seq.cancel()

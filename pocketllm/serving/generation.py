"""One request's answer as it is made: its tokens from the engine turned into text pieces (with
their logprobs, when asked), a stop string ending it early (the request is cancelled, so its slot
frees at the next step), and the finish reason, vLLM's stop reason and usage at the end. Both
endpoints, streamed or not, are built on this; a request of several choices interleaves theirs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pocketllm.serving.engine_client import Sequence
from pocketllm.serving.errors import ApiError
from pocketllm.serving.text import OutputText


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)  # tokens that arrived with this piece
    finish_reason: str | None = None  # on the last piece: "stop" or "length"
    logprobs: list = field(default_factory=list)  # a TokenLogprob per token, when the request asked
    stop_reason: int | str | None = None  # on the last piece: the stop token id or string that ended it (None for eos)
    # Per token, where its text begins in the answer's text: the length of the text the tokens
    # before it decoded to (a token that shows nothing, or completes a character, begins there).
    text_offsets: list[int] = field(default_factory=list)
    # On the first piece, when the request asked: a TokenLogprob per prompt position (the first None).
    prompt_logprobs: list | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


async def pieces(seq: Sequence, text: OutputText, usage: Usage, include_stop: bool = False) -> AsyncIterator[Piece]:
    """The answer's pieces, the last one with its finish reason, the first with the prompt's
    logprobs when the request asked for them. Raises ApiError when the request ends without
    finishing (the server shut down, the engine failed). Leaving early (a client gone) cancels the
    request."""
    stop_token_ids = seq.sampling.stop_token_ids
    prompt = None  # the prompt's logprobs, until a piece carries them

    def with_prompt(piece: Piece) -> Piece:
        nonlocal prompt
        piece.prompt_logprobs, prompt = prompt, None
        return piece

    try:
        while True:
            event = await seq.next()
            if event.error is not None:
                raise event.error
            if event.prompt_logprobs is not None:
                prompt = event.prompt_logprobs
            tokens, logprobs, offsets = [], [], []
            chunk = ""
            if event.token is not None:
                usage.completion_tokens += 1
                tokens.append(event.token)
                offsets.append(len(text.text))
                if event.logprob is not None:
                    logprobs.append(event.logprob)
                # A stop token (eos, stop_token_ids) ends the answer and is no part of its text
                # unless include_stop_str_in_output asks for it.
                if event.finish_reason != "stop" or include_stop:
                    chunk = text.add(event.token)
            if text.stopped:
                seq.cancel(answered_as="stop")
                yield with_prompt(Piece(chunk, tokens, "stop", logprobs, text.stop_reason, offsets))
                return
            if event.finish_reason == "cancelled":
                seq.answered("cancelled")
                raise ApiError(503, "the server shut down before this request finished")
            if event.finish_reason is not None:
                chunk += text.finish()
                if text.stopped:
                    # A stop string the last token (or the final flush) completed: the answer
                    # says stop, whatever ended the engine's request, and /metrics counts it so.
                    seq.answered("stop")
                    yield with_prompt(Piece(chunk, tokens, "stop", logprobs, text.stop_reason, offsets))
                else:
                    seq.answered(event.finish_reason)
                    by_token = event.finish_reason == "stop" and event.token in stop_token_ids
                    yield with_prompt(Piece(chunk, tokens, event.finish_reason, logprobs, event.token if by_token else None, offsets))
                return
            if chunk or tokens:
                yield with_prompt(Piece(chunk, tokens, None, logprobs, text_offsets=offsets))
    finally:
        seq.cancel()


async def interleaved(choices: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(i, piece) for the pieces of every choice's `pieces` as each comes, each choice's in its
    order. The first error of any ends them all (raised here); leaving early closes every one,
    which cancels its request."""
    if len(choices) == 1:
        try:
            async for piece in choices[0]:
                yield 0, piece
        finally:
            await choices[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, parts: AsyncIterator[Piece]) -> None:
        try:
            async for piece in parts:
                queue.put_nowait((i, piece))
            queue.put_nowait((i, done))
        except Exception as exc:  # an ApiError (shut down, engine failed): the request's answer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, parts)) for i, parts in enumerate(choices)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for parts in choices:
            await parts.aclose()

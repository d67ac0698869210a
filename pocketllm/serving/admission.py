"""What a request may cost the HTTP process before the engine sees it. A body too long to hold any
prompt that fits --max-len is refused with a 413 before it is read in full; a prompt's text too long
to fit is refused with a 400 before it is tokenized; and what is left (the JSON checks, the chat
template, the tokenizer) runs in threads beside the event loop, so that a long prompt delays its
own answer and no one else's."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

from pocketllm.serving.errors import ApiError, bad
from pocketllm.serving.token_bytes import MAX_CHAR_BYTES, token_bytes

# JSON may write a one-byte character as a six-byte \u escape.
ESCAPED_BYTES_PER_BYTE = 6
# A token id of a prompt given as ids, with the comma and the indentation a pretty-printer adds.
ID_BYTES = 16
# The fields beside the prompt: sampling options, stop strings, a logit_bias, chat roles.
OTHER_FIELDS_BYTES = 1 << 20


@dataclass(frozen=True)
class Admission:
    """The bounds a request is checked against before it is tokenized. token_bytes: the most bytes
    of text one token stands for (token_bytes.py); None leaves both bounds off."""

    max_len: int
    token_bytes: int | None

    @classmethod
    def of(cls, tokenizer, max_len: int) -> Admission:
        return cls(max_len, token_bytes(tokenizer))

    @property
    def body_limit(self) -> int | None:
        """Bytes of request body that a prompt of max_len tokens, written as JSON, stays within."""
        if self.token_bytes is None:
            return None
        return self.max_len * (ESCAPED_BYTES_PER_BYTE * self.token_bytes + ID_BYTES) + OTHER_FIELDS_BYTES

    def too_large(self, size: int | None) -> ApiError:
        limit = self.body_limit
        what = f"the request body is {size} bytes" if size is not None else "the request body is longer"
        return ApiError(
            413, f"{what}, over this server's limit of {limit} bytes: room for a prompt of --max-len {self.max_len} tokens "
                 f"of at most {self.token_bytes} bytes of text each, JSON-escaped, beside the other fields", code="request_too_large",
        )

    def check_text(self, text: str, param: str) -> None:
        """Refuse a text that needs max_len tokens or more however it is tokenized: a 400 as for a
        prompt of too many tokens, without tokenizing it."""
        if self.token_bytes is None:
            return
        room = (self.max_len - 1) * self.token_bytes
        # Most prompts are cleared by their length in characters, without encoding them.
        if len(text) * MAX_CHAR_BYTES <= room:
            return
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if size > room:
            at_least = -(-size // self.token_bytes)
            raise bad(
                f"the prompt is {size} bytes of text, so at least {at_least} tokens (one stands for {self.token_bytes} bytes at most), "
                f"and this server's context is {self.max_len} (--max-len): leave room for at least one new token",
                param, "context_length_exceeded",
            )


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The text's token ids. encode_batch, unlike encode, releases the GIL while it runs, so the
    event loop and other requests go on meanwhile."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


async def off_loop(fn, *args):
    """fn(*args) in a thread of its own, its exceptions (a request's ApiError) raised here. A thread
    per request rather than a pool's queue: a short prompt never waits for long ones to finish (the
    tokenizer releases the GIL, so they run side by side). Daemon threads: a tokenization whose
    client is gone does not hold the process's exit."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result, exc) -> None:
        if done.cancelled():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # the caller's to raise, whatever it is
            result, exc = None, e
        # The loop may have closed meanwhile (the server stopped): no one is waiting then.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="pocketllm-admission", daemon=True).start()
    return await done

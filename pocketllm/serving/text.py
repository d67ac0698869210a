"""A request's output text as its tokens arrive, with stop strings. Tokens are detokenized
incrementally (tokenizers' DecodeStream, which holds back a token ending inside a multi-byte
character until the character completes); the text is searched for each stop string as it grows,
and text that could be the start of a stop string is held back until it is known not to be, so a
stream never shows a stop string, not even part of one (unless it is to be included, when the
text ends after it). As in vLLM, a stop string ending within the first min_tokens tokens' text does
not count. Without a stop string the text ends equal to the tokenizer's decode of every token after
the prompt's last few (pocketllm.continuation), as `pocketllm generate` prints it."""

from __future__ import annotations

from collections.abc import Sequence

from pocketllm import continuation


class OutputText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True, include_stop: bool = False,
                 min_tokens: int = 0, context: Sequence[int] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.skip_special, self.include_stop, self.min_tokens = skip_special_tokens, include_stop, min_tokens
        self.context = continuation.context_of(tokenizer, context, skip_special_tokens)  # the text continues them
        self._stream = continuation.stream(self.context, skip_special_tokens)
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far, cut before a stop string once one appears
        self.shown = 0  # characters of text handed out
        self.stopped = False  # a stop string appeared: the text ends before it
        self._searched = 0  # text before this offset holds no stop string
        self._failed = False

    def add(self, token: int) -> str:
        """Take one token; returns the text that may be shown now (possibly empty)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        if not self._failed:
            try:
                self.text += self._stream.step(self.tokenizer, token) or ""
            except Exception:  # tokenizers raises its own exception types; fall back to whole decodes
                self._failed = True
        if self._failed:
            self.text = self._decode()
        if len(self.tokens) <= self.min_tokens:
            self._searched = len(self.text)
        else:
            self._find_stop()
        return self._release(final=False)

    def finish(self) -> str:
        """The text still to show once generation ended: what was held back, and any tail the
        incremental decode still held (a character cut short by the last token)."""
        if not self.stopped:
            full = self._decode()
            # A full decode that does not extend what was shown cannot be shown without taking
            # text back; the stream keeps what it sent.
            if full.startswith(self.text[: self.shown]):
                self.text = full
                if len(self.tokens) > self.min_tokens:
                    self._find_stop()
        return self._release(final=True)

    def _decode(self) -> str:
        return continuation.text_after(self.tokenizer, self.context, self.tokens, self.skip_special)

    def _find_stop(self) -> None:
        if not self.stop:
            return
        hits = []
        for s in self.stop:
            at = self.text.find(s, max(0, self._searched - len(s) + 1))
            if at >= 0:
                hits.append((at, s))
        if hits:
            at, s = min(hits)
            self.text = self.text[: at + len(s) if self.include_stop else at]
            self.stopped, self.stop_reason = True, s
        self._searched = len(self.text)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        end = max(end, self.shown)
        chunk = self.text[self.shown : end]
        self.shown = end
        return chunk

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        tail = self.text[self.shown :]
        return max((ends_in_start_of(tail, s) for s in self.stop), default=0)


def ends_in_start_of(text: str, tag: str) -> int:
    """How many of the text's last characters begin `tag` (short of all of it): what a stream
    holds back while it may yet turn out to be the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

"""A chat answer's reasoning told apart from its content (`serve --reasoning-parser qwen3`), as this
model family writes it: the reasoning up to `</think>`, the content after it. Qwen3.5's template
ends the prompt inside an opened `<think>` block, so the answer starts in its reasoning; a prompt
that closes it (chat_template_kwargs enable_thinking false) or opens none leaves the answer all
content unless the answer opens one itself. The newlines that follow `</think>` are the form's, not
the content's. An answer cut inside its reasoning (max_tokens) is all reasoning."""

from __future__ import annotations

from pocketllm.serving.text import ends_in_start_of

OPEN, CLOSE = "<think>", "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a reasoning block open for the answer to go on with."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def split_reasoning(text: str, open_: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer; open_: the prompt left a block open."""
    if not open_:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        text = stripped[len(OPEN) :]
    end = text.find(CLOSE)
    if end < 0:
        return text, ""
    return text[:end], text[end + len(CLOSE) :].lstrip("\n")


class ReasoningStream:
    """A streamed answer cut into reasoning and content as split_reasoning cuts the whole: each
    piece's share of each, text that could still begin a tag (or be the newlines after `</think>`)
    held back until it cannot."""

    def __init__(self, open_: bool):
        self.text = ""
        # Where the text stands: "start" (no block yet, one may open), "reasoning", "content".
        self.state = "reasoning" if open_ else "start"
        self.open_ = open_
        self.sent_reasoning = self.sent_content = 0  # how much of each has gone out

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) to send now, the text so far with `piece`."""
        self.text += piece
        return self._release(final=False)

    def finish(self) -> tuple[str, str]:
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, str]:
        reasoning, content = self._split(final)
        out = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out

    def _split(self, final: bool) -> tuple[str, str]:
        """The reasoning and content that can be told now (all of both when final)."""
        text = self.text
        if not self.open_:
            stripped = text.lstrip()
            if not final and OPEN.startswith(stripped):
                return "", ""  # only whitespace, or what may yet be the opening tag
            if not stripped.startswith(OPEN):
                return "", text
            text = stripped[len(OPEN) :]
        end = text.find(CLOSE)
        if end < 0:
            if final:
                return text, ""
            return text[: len(text) - ends_in_start_of(text, CLOSE)], ""
        content = text[end + len(CLOSE) :]
        if not final and not content.strip("\n"):
            return text[:end], ""  # the newlines after the tag may go on
        return text[:end], content.lstrip("\n")

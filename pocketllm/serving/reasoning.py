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
    held back until it cannot. Only the held-back text is kept and searched: a piece costs its own
    length, not the answer's."""

    def __init__(self, open_: bool):
        # "start" (no block yet, one may open), "reasoning", "after" (the newlines after the
        # closing tag), "content".
        self.state = "reasoning" if open_ else "start"
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) to send now, with `piece`."""
        self.held += piece
        reasoning = content = ""
        if self.state == "start":
            stripped = self.held.lstrip()
            if OPEN.startswith(stripped):
                return "", ""  # only whitespace, or what may yet be the opening tag
            if stripped.startswith(OPEN):
                self.state, self.held = "reasoning", stripped[len(OPEN) :]
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.held.find(CLOSE)
            if end < 0:
                keep = ends_in_start_of(self.held, CLOSE)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return reasoning, ""
            reasoning, self.state, self.held = self.held[:end], "after", self.held[end + len(CLOSE) :]
        if self.state == "after":
            self.held = self.held.lstrip("\n")
            if self.held:
                self.state = "content"
        if self.state == "content":
            content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, once the answer is whole: reasoning cut before its end, or text
        that turned out to begin no tag."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", "" if self.state == "after" else held

"""The text that generated tokens add after their prompt. A token's text can depend on the tokens
before it: a Metaspace (SentencePiece-style) decoder drops the leading space of a sequence's first
token, so " world" generated after "Hello" would decode alone as "world". The generated tokens are
therefore decoded after the last few prompt tokens and the prompt's own text taken off, as vLLM's
detokenizer does; for byte-level tokenizers (the Qwen family's) this is the plain decode."""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens decoded ahead of the generated ones: enough for a decoder's view of "not the
# first token" and a character split across a few byte tokens, few enough to cost nothing.
CONTEXT_TOKENS = 6


def context_of(tokenizer, prompt: Sequence[int], skip_special_tokens: bool = True) -> list[int]:
    """The prompt's last ids the new ones are decoded after: none where their text ends in U+FFFD
    (a prompt cut inside a character, or holding that character), which a DecodeStream seeded with
    them would repeat as the first new text; a character cut at the window's start is left out."""
    ids = [int(t) for t in prompt[-CONTEXT_TOKENS:]]
    while ids and tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).startswith("\ufffd"):
        ids = ids[1:]
    if ids and tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return []
    return ids


def stream(context: Sequence[int], skip_special_tokens: bool = True):
    """A tokenizers DecodeStream whose first step continues `context` (context_of's ids)."""
    from tokenizers.decoders import DecodeStream

    if not context:
        return DecodeStream(skip_special_tokens=skip_special_tokens)
    return DecodeStream(list(context), skip_special_tokens=skip_special_tokens)


def text_after(tokenizer, context: Sequence[int], tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
    """What `tokens` decode to after `context`; the plain decode of `tokens` where the context's
    text is not a prefix of the whole (a decoder that rewrites across the seam)."""
    tokens = list(tokens)
    if context:
        before = tokenizer.decode(list(context), skip_special_tokens=skip_special_tokens)
        whole = tokenizer.decode(list(context) + tokens, skip_special_tokens=skip_special_tokens)
        if whole.startswith(before) and not before.endswith("\ufffd"):
            return whole[len(before) :]
    return tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

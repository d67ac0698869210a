"""Logprobs as each endpoint answers them. A token is named by its own decode (special tokens
included, a byte cut from its character as U+FFFD), or as `token_id:N` with vLLM's
return_tokens_as_token_ids; -inf, which JSON cannot carry, is written as -9999.0, as OpenAI's API
and vLLM write it.

/v1/completions (`logprobs: N`): {tokens, token_logprobs, top_logprobs, text_offset}, each
position's top_logprobs holding the N likeliest tokens and the chosen one; with echo, the prompt's
tokens first, the first of them with null logprobs (nothing comes before it), as OpenAI's API
and vLLM answer it.
/v1/chat/completions (`logprobs: true`, `top_logprobs: N`): {content: [{token, logprob, bytes,
top_logprobs: the N likeliest, likeliest first}]}, `bytes` each token's own bytes (TokenBytes)."""

from __future__ import annotations

from pocketllm.byte_level import byte_symbols

FLOOR = -9999.0


class TokenBytes:
    """Each token's own bytes, as OpenAI's chat logprobs give them: joined, they are the answer's
    UTF-8, a character split over tokens included. Read from a byte-level vocabulary's entry or an
    added token's text; for another kind of tokenizer, the UTF-8 of the token's own decode (U+FFFD
    for part of a character). Built once per served tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added = {i: t.content.encode() for i, t in tokenizer.get_added_tokens_decoder().items()}
        byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self.byte_of = {sym: b for b, sym in byte_symbols().items()} if byte_level else None

    def __call__(self, token: int) -> list[int]:
        if token in self.added:
            return list(self.added[token])
        if self.byte_of is not None:
            entry = self.tokenizer.id_to_token(token)
            if entry is not None and all(c in self.byte_of for c in entry):
                return [self.byte_of[c] for c in entry]
        return list(self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8", errors="replace"))


class Names:
    """How tokens are named in logprobs; token_bytes, their bytes (chat's logprobs)."""

    def __init__(self, tokenizer, as_ids: bool = False, token_bytes: TokenBytes | None = None):
        self.tokenizer, self.as_ids, self.token_bytes = tokenizer, as_ids, token_bytes
        self._names: dict[int, str] = {}  # a prompt's logprobs name the same few tokens many times

    def __call__(self, token: int) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        name = self._names.get(token)
        if name is None:
            name = self._names[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return name


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(name: Names, logprobs: list, offsets: list[int]) -> dict:
    """The logprobs object for these tokens, each beginning at its character offset of the
    choice's text (not the sum of the names before it: a token's own decode, U+FFFD for part of a
    character, or `token_id:N`, is not its share of the text)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp, offset in zip(logprobs, offsets, strict=True):
        out["tokens"].append(name(lp.token))
        out["token_logprobs"].append(_value(lp.logprob))
        out["top_logprobs"].append(_top(name, lp))
        out["text_offset"].append(offset)
    return out


def _top(name: Names, lp) -> dict[str, float]:
    """The N likeliest and the chosen token, by name. Likeliest first: where two tokens share a
    name, the name keeps the higher logprob."""
    top: dict[str, float] = {}
    for t, v in [*lp.top, (lp.token, lp.logprob)]:
        top.setdefault(name(t), _value(v))
    return top


def prompt_offsets(tokenizer, ids: list[int], text: str | None = None) -> list[int]:
    """Where each prompt token's text begins in the echoed prompt: `text` as sent, or the ids'
    decode (special tokens included) where they came as ids. A text the ids do not decode back to
    (a BOS the tokenizer adds, a normalizer) is measured by the tokenizer's own offsets into it."""
    if text is not None and tokenizer.decode(ids, skip_special_tokens=False) != text:
        for special in (True, False):
            encoding = tokenizer.encode(text, add_special_tokens=special)
            if encoding.ids == ids:
                return [start for start, _ in encoding.offsets]
        return [min(o, len(text)) for o in _decoded_offsets(tokenizer, ids)]
    return _decoded_offsets(tokenizer, ids)


def _decoded_offsets(tokenizer, ids: list[int]) -> list[int]:
    from tokenizers.decoders import DecodeStream

    stream, text, offsets = DecodeStream(skip_special_tokens=False), 0, []
    for t in ids:
        offsets.append(text)
        try:
            text += len(stream.step(tokenizer, t) or "")
        except Exception:  # tokenizers raises its own exception types: the rest as whole decodes
            return offsets[:-1] + [len(tokenizer.decode(ids[:i], skip_special_tokens=False)) for i in range(len(offsets) - 1, len(ids))]
    return offsets


def completion_prompt_logprobs(name: Names, prompt: list[int], logprobs: list, offsets: list[int]) -> dict:
    """The echoed prompt's part of a completion's logprobs: logprobs[p] is position p's
    TokenLogprob (None for the first)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp, offset in zip(prompt, logprobs, offsets, strict=True):
        out["tokens"].append(name(t))
        out["token_logprobs"].append(None if lp is None else _value(lp.logprob))
        out["top_logprobs"].append(None if lp is None else _top(name, lp))
        out["text_offset"].append(offset)
    return out


def chat_logprobs(name: Names, logprobs: list) -> dict:
    return {"content": [{**_entry(name, lp.token, lp.logprob), "top_logprobs": [_entry(name, t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def _entry(name: Names, token: int, logprob: float) -> dict:
    return {"token": name(token), "logprob": _value(logprob), "bytes": name.token_bytes(token)}

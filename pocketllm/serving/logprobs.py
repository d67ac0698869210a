"""Logprobs as each endpoint answers them. A token is named by its own decode (special tokens
included, a byte cut from its character as U+FFFD), or as `token_id:N` with vLLM's
return_tokens_as_token_ids; -inf, which JSON cannot carry, is written as -9999.0, as OpenAI's API
and vLLM write it.

/v1/completions (`logprobs: N`): {tokens, token_logprobs, top_logprobs, text_offset}, each
position's top_logprobs holding the N likeliest tokens and the chosen one.
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

    def __call__(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.tokenizer.decode([token], skip_special_tokens=False)


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(name: Names, logprobs: list, offsets: list[int]) -> dict:
    """The logprobs object for these tokens, each beginning at its character offset of the
    choice's text (not the sum of the names before it: a token's own decode, U+FFFD for part of a
    character, or `token_id:N`, is not its share of the text)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp, offset in zip(logprobs, offsets, strict=True):
        top: dict[str, float] = {}
        # Likeliest first: where two tokens share a name, the name keeps the higher logprob.
        for t, v in [*lp.top, (lp.token, lp.logprob)]:
            top.setdefault(name(t), _value(v))
        name_ = name(lp.token)
        out["tokens"].append(name_)
        out["token_logprobs"].append(_value(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
    return out


def chat_logprobs(name: Names, logprobs: list) -> dict:
    return {"content": [{**_entry(name, lp.token, lp.logprob), "top_logprobs": [_entry(name, t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def _entry(name: Names, token: int, logprob: float) -> dict:
    return {"token": name(token), "logprob": _value(logprob), "bytes": name.token_bytes(token)}

"""The most bytes of a request's text that one token of a tokenizer can stand for, read from its
tokenizer.json: its longest vocabulary entry, times what its normalizer may fold into one byte.
A text longer than that times --max-len cannot fit, and is refused before it is tokenized
(admission.py). A tokenizer that can drop text (a normalizer that strips, a pre-tokenizer that
splits on whitespace and drops it, an added token that swallows the spaces beside it, unknown
characters fused into one token) has no such bound: None, and its prompts are tokenized whole."""

from __future__ import annotations

import json
import math

# The longest character in UTF-8: an unknown character becomes one token, however long it is.
MAX_CHAR_BYTES = 4
# Unicode normalization folds at most this many bytes of text into one: NFKC makes a four-byte
# mathematical digit one ASCII digit, NFC a Greek letter and its two marks one letter, lowercasing
# the Kelvin sign a plain k.
UNICODE_FOLD = 4

_UNICODE = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
# Normalizers that only add text.
_ADDING = {"Prepend", "ByteLevel"}
# Pre-tokenizers that split text without dropping any of it (Split and Punctuation unless their
# behavior is Removed).
_SPLITTING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def token_bytes(tokenizer) -> int | None:
    """Bytes of text per token at most, or None when the tokenizer can drop text."""
    spec = json.loads(tokenizer.to_str())
    fold = _fold(spec.get("normalizer"))
    byte_level = "ByteLevel" in _types(spec.get("pre_tokenizer"), "pretokenizers")
    if fold is None or not _keeps_text(spec.get("pre_tokenizer")) or not _bounded_unknowns(spec.get("model") or {}, byte_level):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    # A byte-level vocabulary writes each byte as one character, which UTF-8 may spend two bytes on.
    entries = _vocab(spec["model"])
    longest = max((len(e) if byte_level else len(e.encode()) for e in entries), default=0)
    longest = max([longest, MAX_CHAR_BYTES, *(len(t["content"].encode()) for t in added)])
    return longest * fold


def _vocab(model: dict):
    vocab = model.get("vocab") or {}
    # Unigram's vocab is a list of [piece, score]; the others map pieces to ids.
    return [piece for piece, _score in vocab] if isinstance(vocab, list) else list(vocab)


def _types(component, key: str) -> list[str]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [t for c in component.get(key, []) for t in _types(c, key)]
    return [component.get("type")]


def _fold(normalizer) -> int | None:
    """How many bytes of text the normalizer may make one byte; None when it may drop text."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        folds = [_fold(n) for n in normalizer.get("normalizers", [])]
        return None if None in folds else math.prod(folds)
    if kind in _UNICODE:
        return UNICODE_FOLD
    if kind in _ADDING:
        return 1
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        if pattern is None or not content:
            return None
        return max(1, math.ceil(len(pattern.encode()) / len(content.encode())))
    return None


def _keeps_text(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") in _SPLITTING and pre_tokenizer.get("behavior") != "Removed"


def _bounded_unknowns(model: dict, byte_level: bool) -> bool:
    """Every character ends up in some token: none is unknown (a byte-level vocabulary), or an
    unknown one becomes its bytes' tokens, or a token of its own; never one token for a run of
    them, and never nothing (BPE drops an unknown character when it has no unk token)."""
    kind = model.get("type")
    if kind == "BPE":
        return byte_level or model.get("byte_fallback", False) or (model.get("unk_token") is not None and not model.get("fuse_unk"))
    # Unigram fuses a run of unknown characters into one token unless it falls back to bytes.
    return kind == "Unigram" and model.get("byte_fallback", False)

"""Byte-level BPE's alphabet (GPT-2's, which Qwen's tokenizers use): each byte written as one
printable character, so a vocabulary entry spells the bytes it stands for."""

from __future__ import annotations


def byte_symbols() -> dict[int, str]:
    """The printable symbol byte-level BPE uses for each byte (the GPT-2 table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols

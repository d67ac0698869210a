"""generate --stream's text: whole characters as they complete, and a held-back tail at the end."""

from __future__ import annotations

from pocketllm.commands.generate import TextStream
from pocketllm.commands.make_checkpoint import write_byte_tokenizer
from pocketllm.inputs import load_tokenizer


def test_a_split_character_waits_and_a_cut_one_ends_the_text(tmp_path, capsys):
    write_byte_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(str(tmp_path))
    stream = TextStream(tokenizer)
    shown = []
    # "h", then "é" as two bytes (195, 169), then the first byte of another two-byte character.
    for token in (104, 195, 169, 195):
        stream(token)
        shown.append(capsys.readouterr().out)
    assert shown == ["h", "", "é", ""]
    # The cut byte decodes to a replacement character: finish() prints it, so the whole output
    # reads as the tokenizer's decode of every token.
    assert tokenizer.decode([104, 195, 169, 195]) == "hé\ufffd"
    stream.finish([104, 195, 169, 195])
    assert capsys.readouterr().out == "\ufffd\n"

"""serve's output text: stop strings cut the text before them, never show even part of one in a
stream, and without one the streamed pieces add up to the tokenizer's decode of every token."""

from __future__ import annotations

import pytest

from pocketllm.commands.make_checkpoint import write_byte_tokenizer
from pocketllm.inputs import load_tokenizer
from pocketllm.serving.text import OutputText


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytes")
    write_byte_tokenizer(d / "tokenizer.json")
    return load_tokenizer(str(d))


def feed(tokenizer, text: str, stop=(), **options):
    """Every byte of text as a token; the pieces shown after each, and finish()'s."""
    out = OutputText(tokenizer, tuple(stop), **options)
    pieces = []
    for b in text.encode():
        pieces.append(out.add(b))
        if out.stopped:
            break
    pieces.append(out.finish())
    return out, pieces


def test_without_stop_strings_the_pieces_are_the_whole_decode(tokenizer):
    text = "héllo wörld €"
    out, pieces = feed(tokenizer, text)
    assert "".join(pieces) == text and not out.stopped
    # A character split over tokens appears once it is whole.
    assert pieces[:3] == ["h", "", "é"]


def test_a_stop_string_cuts_the_text_and_no_part_of_it_is_shown(tokenizer):
    out, pieces = feed(tokenizer, "one two STOP three", stop=["STOP"])
    assert "".join(pieces) == "one two " and out.stopped
    # "S", "ST", "STO" were held back, not shown and then taken back.
    assert all("S" not in p for p in pieces)


def test_held_back_text_that_is_no_stop_string_is_shown_after_all(tokenizer):
    out, pieces = feed(tokenizer, "a STOx b", stop=["STOP"])
    assert "".join(pieces) == "a STOx b" and not out.stopped
    assert pieces[2:6] == ["", "", "", "STOx"]


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    out, pieces = feed(tokenizer, "abc END xyz. more", stop=[".", "END"])
    assert "".join(pieces) == "abc " and out.stopped


def test_a_stop_string_across_a_split_character(tokenizer):
    out, pieces = feed(tokenizer, "naïve café", stop=["é"])
    assert "".join(pieces) == "naïve caf" and out.stopped


def test_a_stop_string_in_the_tail_finish_decodes_is_cut_too(tokenizer):
    # The last token cuts a character short: only the final decode shows the replacement
    # character, which is itself the stop string here.
    out = OutputText(tokenizer, ("\ufffd",))
    shown = "".join(out.add(t) for t in (104, 105, 195))
    shown += out.finish()
    assert shown == "hi" and out.stopped


def test_include_stop_keeps_the_stop_string_and_min_tokens_lets_an_early_one_pass(tokenizer):
    out, pieces = feed(tokenizer, "one XY two XY three", stop=["XY"], include_stop=True)
    assert "".join(pieces) == "one XY" and out.stop_reason == "XY"
    # The first "XY" ends within the first 7 tokens, so it does not count; the second does.
    out, pieces = feed(tokenizer, "one XY two XY three", stop=["XY"], min_tokens=7)
    assert "".join(pieces) == "one XY two " and out.stopped


def test_an_echoed_prompts_offsets_are_into_the_text_as_sent(tokenizer):
    # A tokenizer that adds a BOS: the ids decode to "<256>hello", the echo shows "hello".
    from tokenizers import AddedToken, Tokenizer, processors

    from pocketllm.serving.logprobs import prompt_offsets

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_special_tokens([AddedToken("<256>", normalized=False, special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<256> $A", special_tokens=[("<256>", 256)])
    ids = tok.encode("héllo").ids
    assert ids[0] == 256 and len(ids) == 7
    assert prompt_offsets(tok, ids, "héllo") == [0, 0, 1, 1, 2, 3, 4]
    # Given as ids, the echo is their decode, BOS included: offsets into it.
    assert prompt_offsets(tok, ids) == [0, 5, 6, 6, 7, 8, 9]
    assert prompt_offsets(tokenizer, list("héllo".encode()), "héllo") == [0, 1, 1, 2, 3, 4]

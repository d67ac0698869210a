"""Generated text continues its prompt's: with a tokenizer whose decoder drops a sequence's first
leading space (Metaspace), the first generated word still has its space, in generate's printed and
streamed text as in serve's (tests/test_serve_sampling.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import generated_ids, main_in_process, metaspace_tokenizer, words

from pocketllm.commands.generate import TextStream
from pocketllm.continuation import text_after
from pocketllm.serving.text import OutputText


@pytest.fixture(scope="module")
def tok():
    return metaspace_tokenizer(50)


def test_the_text_after_a_prompt_keeps_its_first_space_which_a_plain_decode_drops(tok):
    assert tok.decode([3, 4]) == "w3 w4"
    assert text_after(tok, [1, 2], [3, 4]) == " w3 w4"
    assert text_after(tok, [], [3, 4]) == "w3 w4"  # no prompt: the text begins the sequence


def test_served_and_streamed_text_continue_the_prompt(tok, capsys):
    out = OutputText(tok, (" w4",), include_stop=True, context=[1, 2])
    assert "".join([out.add(3), out.add(4), out.add(5), out.finish()]) == " w3 w4" and out.stopped
    stream = TextStream(tok, [1, 2])
    for t in (3, 4):
        stream(t)
    stream.finish([3, 4])
    assert capsys.readouterr().out == " w3 w4\n"


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt, tmp_path_factory):
    from pocketllm.config import load_config

    d = tmp_path_factory.mktemp("metaspace")
    for f in tiny_ckpt.iterdir():
        if f.name != "tokenizer.json":
            (d / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
    metaspace_tokenizer(load_config(d).vocab_size).save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("how", [(), ("--stream",), ("--prompts-file",)], ids=["printed", "streamed", "listed"])
def test_generate_prints_the_text_after_the_prompt(ckpt, how, capsys, tmp_path):
    if how == ("--prompts-file",):
        (tmp_path / "p.txt").write_text("w1 w2\n")
        how = ("--prompts-file", tmp_path / "p.txt")
    else:
        how = (*how, "--prompt", "w1 w2")
    assert main_in_process("generate", "--ckpt", ckpt, "--dtype", "float32", "--max-new-tokens", 4, "--ignore-eos", *how) == 0
    out = capsys.readouterr().out
    ids = generated_ids(out)
    text = [line for line in out.splitlines() if not line.startswith("generated_ids=")]
    want = "text=" + json.dumps(words(ids)) if "--prompts-file" in how else words(ids)
    assert text == [want], out


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    from pocketllm.commands.make_checkpoint import write_byte_tokenizer
    from pocketllm.inputs import load_tokenizer

    d = tmp_path_factory.mktemp("bytes")
    write_byte_tokenizer(d / "tokenizer.json")
    return load_tokenizer(str(d))


@pytest.mark.parametrize("prompt", [
    [*b"caf", 0xC3],  # cut inside "é": the new tokens may complete it
    [*"abc \ufffd".encode()],  # the replacement character itself, as scraped text holds it
    [*"\U0001F600".encode(), *b"abcde"],  # a character cut at the window's start
], ids=["cut-character", "replacement-character", "cut-at-the-window"])
def test_a_prompt_ending_in_a_replacement_character_never_shows_in_the_new_text(byte_tok, prompt, capsys):
    new = [0xA9, *b" ok"]
    want = byte_tok.decode(new)  # "\ufffd ok": the new tokens' own text, none of the prompt's
    out = OutputText(byte_tok, (), context=prompt)
    assert "".join([*(out.add(t) for t in new), out.finish()]) == want
    stream = TextStream(byte_tok, prompt)
    for t in new:
        stream(t)
    stream.finish(new)
    assert capsys.readouterr().out == want + "\n"

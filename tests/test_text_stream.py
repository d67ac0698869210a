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


def test_generate_streams_every_token_as_it_comes(tiny_ckpt, capsys, monkeypatch):
    # In process at one rank, so the stream can be watched: the k-th token reaches it after k
    # decode steps (as it is chosen, not after the generation), and what it printed plus
    # finish()'s tail is the plain run's text.
    from conftest import generated_ids, main_in_process
    from pocketllm.commands import generate as command
    from pocketllm.engine.runner import Engine

    decodes, fed, shown, rows = [], [], [], []
    real_run, real_row = Engine.run_packed, Engine.greedy_row
    real_step, real_finish = command.TextStream.__call__, command.TextStream.finish

    def run(self, spans, **kw):
        if not rows:
            decodes.extend(start for _, start, _ in spans if start > 0)
        return real_run(self, spans, **kw)

    def row(self, slot, pos, token):
        # A greedy decode row, straight to the step or through a pass (counted once).
        decodes.append(pos)
        rows.append(pos)
        try:
            return real_row(self, slot, pos, token)
        finally:
            rows.pop()

    def step(self, token):
        fed.append((token, len(decodes)))
        real_step(self, token)

    def finish(self, tokens):
        shown.append(self.shown)
        real_finish(self, tokens)

    monkeypatch.setattr(Engine, "run_packed", run)
    monkeypatch.setattr(Engine, "greedy_row", row)
    monkeypatch.setattr(command.TextStream, "__call__", step)
    monkeypatch.setattr(command.TextStream, "finish", finish)
    # --device cpu: this process is the rank, and must not bind a GPU it cannot unbind.
    args = ("generate", "--ckpt", tiny_ckpt, "--prompt", "hello", "--max-new-tokens", 40, "--device", "cpu")
    assert main_in_process(*args, "--stream") == 0
    streamed = capsys.readouterr().out
    assert main_in_process(*args) == 0
    ids_line, text = capsys.readouterr().out.split("\n", 1)
    tokens = generated_ids(ids_line)
    assert fed == [(t, k) for k, t in enumerate(tokens)] and len(tokens) == 40
    assert shown[0] and text.startswith(shown[0])  # the tiny model's bytes include whole characters
    assert streamed == text + ids_line + "\n"


def test_a_failing_stream_ends_with_the_whole_text(tmp_path, capsys):
    write_byte_tokenizer(tmp_path / "tokenizer.json")
    stream = TextStream(load_tokenizer(str(tmp_path)))
    stream(104)

    class Broken:
        def step(self, tokenizer, token):
            raise RuntimeError("decoder state lost")

    stream.stream = Broken()
    stream(105)
    stream(33)
    stream.finish([104, 105, 33])
    assert capsys.readouterr().out == "h\nhi!\n"

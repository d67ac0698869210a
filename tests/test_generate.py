"""Generation end to end through the CLI, in this process: the checkpoint's eos token stops
generation unless --ignore-eos. (Seeded sampling at every world size: test_hf_oracle.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from conftest import CLI_ENTRY, TAG, cli_env, generated_ids, main_in_process, run_cli, tagged

PROMPT = "11,12,13,14,15,16,17,18,19,20"


def generated(capsys, *argv) -> list[int]:
    capsys.readouterr()
    rc = main_in_process("generate", *argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return generated_ids(out.out)


def test_eos_stops_generation_unless_ignored(tiny_ckpt, tmp_path, capsys):
    greedy = generated(capsys, "--ckpt", tiny_ckpt, "--token-ids", PROMPT, "--max-new-tokens", 6)
    eos = greedy[2]
    ckpt = tmp_path / "with_eos"
    ckpt.mkdir()
    for f in tiny_ckpt.iterdir():
        (ckpt / f.name).symlink_to(f)
    (ckpt / "config.json").unlink()
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["eos_token_id"] = eos
    (ckpt / "config.json").write_text(json.dumps(config))
    stopped = generated(capsys, "--ckpt", ckpt, "--token-ids", PROMPT, "--max-new-tokens", 6)
    assert stopped == greedy[: greedy.index(eos) + 1]
    ignored = generated(capsys, "--ckpt", ckpt, "--token-ids", PROMPT, "--max-new-tokens", 6, "--ignore-eos")
    assert ignored == greedy


@pytest.mark.timeout(60)
def test_a_reader_that_stops_reading_ends_the_run_quietly_with_sigpipes_status(tiny_ckpt, tmp_path):
    """`pocketllm generate ... | head`: the command (at TP=2 its launcher) ends at once with a
    shell's status for SIGPIPE (141) and no traceback or error line, every rank with it."""
    runs = {}
    for world in (1, 2):
        tag = uuid.uuid4().hex
        cmd = [sys.executable, "-c", CLI_ENTRY, "generate", "--ckpt", str(tiny_ckpt), "--prompt", "Hello", "--stream", "--ignore-eos",
               "--max-new-tokens", "2000", "--tp-world", str(world)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(**{TAG: tag}))
        proc.stdout.close()  # the reader gone before the first token
        runs[world] = proc, tag
    for world, (proc, tag) in runs.items():
        _, err = proc.communicate(timeout=50)
        assert proc.returncode == 141, (world, err)
        assert "Traceback" not in err and "error" not in err, (world, err)
        assert not tagged(tag), world


def test_several_prompts_texts_are_one_json_line_each_and_ids_without_text_are_noted(tiny_ckpt, capsys):
    from pocketllm.inputs import load_tokenizer

    capsys.readouterr()
    assert main_in_process("generate", "--ckpt", tiny_ckpt, "--token-ids", "104,101", "--token-ids", "10,10,10", "--max-new-tokens", 8) == 0
    out, err = capsys.readouterr()
    ids = [[int(t) for t in line.split("=", 1)[1].split(",")] for line in out.splitlines() if line.startswith("generated_ids=")]
    texts = [json.loads(line.split("=", 1)[1]) for line in out.splitlines() if line.startswith("text=")]
    tok = load_tokenizer(tiny_ckpt)
    assert len(ids) == 2 and texts == [tok.decode(i) for i in ids]
    # The byte-level tokenizer has 256 tokens; the model's vocab is 1000.
    past = sum(t >= 256 for i in ids for t in i)
    assert past, ids
    assert f"note: {past} of the 16 generated ids are past tokenizer.json's 256 tokens and show no text" in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_ctrl_c_prints_what_was_generated_before_it(tmp_path, world):
    """Ctrl-C in a long generation: the tokens chosen so far are printed as a finished run's are,
    a note says how many of how many, and the run ends as interrupted (130); at TP=2 the
    launcher passes it to rank 0, which prints them, and then stops the other rank."""
    import signal

    from conftest import start

    # Rank 0 stops at its first decode pass, the first token chosen (from the prompt's pass): the
    # Ctrl-C then lands mid-generation however loaded the machine is.
    run = start("generate", "--preset", "tiny", "--token-ids", "1,2,3", "--max-new-tokens", 32000, "--tp-world", world, tmp_path=tmp_path,
                env={"POCKETLLM_FAULT": "rank=0,at=decode,kind=hang"})
    run.line_time("injected fault")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 130, run.stderr
    (line,) = run.stdout.splitlines()
    assert line.startswith("generated_ids=") and len(line.split(",")) == 1, line[:200]
    assert "note: interrupted after 1 of 32000 new tokens" in run.stderr
    assert "pocketllm: interrupted" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert run.last_line == ("pocketllm: interrupted" if world == 1 else "pocketllm: error: got SIGINT; stopped every rank"), run.stderr


def test_a_closed_stdout_or_stderr_is_taken_as_dev_null():
    """`>&-` or a daemon's start: stdout closed, the run ends 0 with no traceback (sys.stdout was
    None); stderr closed at TP=2, the ranks' notes do not land among the results on stdout (the
    next file opened took the closed number)."""
    args = ("generate", "--preset", "tiny", "--token-ids", "1,2", "--max-new-tokens", "2")
    closed_out = run_cli(*args, preexec_fn=lambda: os.close(1))
    assert closed_out.returncode == 0 and "Traceback" not in closed_out.stderr, closed_out.stderr
    closed_err = run_cli(*args, "--tp-world", "2", preexec_fn=lambda: os.close(2))
    assert closed_err.returncode == 0 and len(closed_err.stdout.splitlines()) == 1, closed_err.stdout
    assert closed_err.stdout.startswith("generated_ids=")


@pytest.mark.timeout(60)
def test_text_a_stdouts_encoding_cannot_hold_is_one_line():
    """PYTHONIOENCODING=ascii (or a console's code page) and a token's text outside it: one line
    naming the encoding, not an encoding traceback halfway through the results."""
    import io

    from pocketllm.stdout_gone import StdoutError, _GuardedStdout

    raw = io.BytesIO()
    out = _GuardedStdout(io.TextIOWrapper(raw, encoding="ascii"))
    out.write("generated_ids=1,2\n")
    with pytest.raises(StdoutError, match="its encoding, ascii, has no '中' \\(PYTHONIOENCODING=utf-8 gives it one\\)"):
        out.write("ok 中\n")
    out.flush()
    assert raw.getvalue() == b"generated_ids=1,2\n"


def test_results_that_cannot_be_written_to_stdout_are_one_line():
    """`> file` on a full disk (here the full device): the one line says so, exit 2."""
    cmd = [sys.executable, "-c", CLI_ENTRY, "generate", "--preset", "tiny", "--token-ids", "1,2", "--max-new-tokens", "2"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, env=cli_env(), timeout=50)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == "pocketllm: error: cannot write the results to stdout (No space left on device)"

"""make-checkpoint and quantize write a checkpoint whole or not at all: a non-empty --out is
refused before any work and left as it was; a write that fails or is interrupted (SIGTERM too)
leaves neither --out nor its hidden work directory behind; a finished one has a plain
directory's mode."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import main_in_process, usage_error_in_process
from pocketllm.loader.new_dir import check_new_dir, written_whole


def listing(path):
    return sorted((p.name, p.stat().st_size) for p in path.iterdir())


def test_a_non_empty_out_is_refused_and_left_as_it_was(ckpt_copy, tiny_ckpt, tmp_path, capsys, no_ranks):
    before = listing(ckpt_copy)
    usage_error_in_process(capsys, "make-checkpoint", "--preset", "small", "--out", ckpt_copy, expect=(str(ckpt_copy), "not empty"))
    usage_error_in_process(capsys, "quantize", "--ckpt", tiny_ckpt, "--out", ckpt_copy, "--scheme", "int8", expect=("not empty",))
    assert listing(ckpt_copy) == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    usage_error_in_process(capsys, "make-checkpoint", "--preset", "tiny", "--out", afile, expect=("not a directory",))
    usage_error_in_process(capsys, "quantize", "--ckpt", tiny_ckpt, "--out", afile / "q", "--scheme", "int8", expect=(f"--out {afile / 'q'}: {afile} is not a directory",))
    usage_error_in_process(capsys, "make-checkpoint", "--preset", "tiny", "--out", "", expect=("--out is empty",))
    usage_error_in_process(capsys, "quantize", "--ckpt", tiny_ckpt, "--out", "", "--scheme", "int8", expect=("--out is empty",))
    assert afile.read_text() == "x"
    # Inside the checkpoint it would be a folder of it, for every later quantize of it to list.
    inside = ckpt_copy / "q" / "int8"
    usage_error_in_process(capsys, "quantize", "--ckpt", ckpt_copy, "--out", inside, "--scheme", "int8", expect=(f"--out {inside} is inside --ckpt {ckpt_copy}",))
    assert listing(ckpt_copy) == before


def test_an_empty_out_is_written_with_a_plain_directorys_mode(tiny_ckpt, tmp_path, capsys, no_ranks):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main_in_process("quantize", "--ckpt", tiny_ckpt, "--out", empty, "--scheme", "int8") == 0
    fresh = tmp_path / "a" / "b"
    assert main_in_process("make-checkpoint", "--preset", "tiny", "--out", fresh) == 0
    # stderr is no terminal here: no progress bar left in it as carriage-return lines (a log's).
    assert "\r" not in capsys.readouterr().err
    umask = os.umask(0)
    os.umask(umask)
    for out in (empty, fresh):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
        assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("how", ["error", "SIGTERM", "SIGHUP"])
def test_a_failed_or_interrupted_write_leaves_nothing(tmp_path, how):
    """SIGHUP as SIGTERM: the terminal a write was started from closed."""
    out = check_new_dir(str(tmp_path / "out"))
    raised = RuntimeError if how == "error" else KeyboardInterrupt
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    with pytest.raises(raised):
        with written_whole(out) as work:
            (work / "model.safetensors").write_bytes(b"\0" * 1024)
            if how == "error":
                raise RuntimeError("the writer failed")
            os.kill(os.getpid(), getattr(signal, how))
            time.sleep(5)  # the handler raises at the next bytecode, long before this ends
    assert list(tmp_path.iterdir()) == []
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_work_directory_left_by_a_killed_writer_is_removed_by_the_next_write(tmp_path, capsys):
    """SIGKILL leaves no chance to clean up: the next write of the same --out on this host removes
    the hidden directory whose writer is gone, and says so; a live writer's, another name's and
    another host's are left alone."""
    from pocketllm.loader import new_dir

    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # above pid_max: never a live process
    out = tmp_path / "ckpt"
    host = new_dir._HOST
    left = {name: tmp_path / name for name in (f".ckpt.partial-{host}-{dead}-0123abcd", f".ckpt.partial-{host}-{os.getpid()}-0123abcd",
                                               f".other.partial-{host}-{dead}-0123abcd", f".ckpt.partial-elsewhere-{dead}-0123abcd")}
    for d in left.values():
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 100)
    with written_whole(check_new_dir(str(out))) as work:
        (work / "config.json").write_text("{}")
    assert (out / "config.json").is_file()
    gone = f".ckpt.partial-{host}-{dead}-0123abcd"
    assert [name for name, d in left.items() if not d.exists()] == [gone]
    assert f"note: removed {left[gone]}, left by an earlier run writing ckpt that was killed" in capsys.readouterr().err


def test_quantize_copies_the_checkpoints_files_and_names_the_folders_it_leaves(ckpt_copy, tmp_path, capsys):
    (ckpt_copy / "original").mkdir()
    (ckpt_copy / "original" / "consolidated.pth").write_bytes(b"x")
    (ckpt_copy / "README.md").write_text("notes")
    out = tmp_path / "q"
    assert main_in_process("quantize", "--ckpt", ckpt_copy, "--out", out, "--scheme", "int8") == 0
    assert (out / "README.md").read_text() == "notes" and (out / "tokenizer.json").is_file()
    assert not (out / "original").exists()
    assert capsys.readouterr().out.rstrip().endswith("; not copied: original/")

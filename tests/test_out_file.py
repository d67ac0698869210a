"""A results file a command writes (--json, --out, --logits-out): written whole or not at all, a
link kept a link, a device or FIFO written into rather than replaced, a failed write one line."""

from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import main_in_process

from pocketllm.errors import UsageError
from pocketllm.out_file import write_json, write_out


def test_a_regular_file_is_replaced_whole_and_a_link_stays_a_link(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    write_json(str(link), "--json", {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
    # An existing file keeps its mode; nothing else is left in the directory.
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]


def test_a_failed_write_leaves_the_file_as_it_was_and_no_partial_file(tmp_path):
    out = tmp_path / "r.json"
    out.write_text("old")

    def fails(path: str) -> None:
        with open(path, "w") as f:
            f.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(UsageError, match=r"^--json .*r.json: cannot write \(No space left on device\); the file there is as it was$"):
        write_out(str(out), "--json", fails)
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(UsageError, match="nothing was left there"):
        write_out(str(tmp_path / "new.json"), "--json", fails)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_fifo_gets_the_bytes(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    pid = os.fork()
    if pid == 0:  # the writer, as a command writing --json into a FIFO a reader holds
        try:
            write_json(str(fifo), "--json", {"a": 1})
        finally:
            os._exit(0)
    with open(fifo) as f:
        assert json.loads(f.read()) == {"a": 1}
    os.waitpid(pid, 0)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_logits_out_into_a_fifo_and_onto_a_full_disk(tmp_path, capsys, monkeypatch):
    """Never a real device here: a regression would replace it, for the whole machine."""
    import threading

    import safetensors.torch
    from safetensors import SafetensorError

    argv = ("generate", "--preset", "tiny", "--token-ids", "1,2", "--max-new-tokens", "1", "--dtype", "float32", "--logits-out")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main_in_process(*argv, fifo) == 0
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and safetensors.torch.load(got[0])["logits"].shape[0] == 2

    def full(tensors, path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "l.safetensors"
    capsys.readouterr()
    assert main_in_process(*argv, out) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"pocketllm: error: --logits-out {out}: cannot write (No space left on device (os error 28)); "
                                    "nothing was left there") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]

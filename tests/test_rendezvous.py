"""Rendezvous is checked and bounded: a --rendezvous-file file left by an earlier run is refused with
the command that clears it (and the run works once it is cleared), a missing rank 0 is waited for
only POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS x 10 ms, a rank 0 ended by SIGTERM while it waits leaves
no file behind, and an unwritable directory or a busy port is
one line naming it; a device backend's group also carries CPU tensors (through gloo). The
launcher's own private directory is checked in test_faults.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import assert_nothing_left, main_in_process, start, usage_error_in_process
from pocketllm.distributed import rendezvous
from pocketllm.distributed.rendezvous import backend_spec

ARGS = ["generate", "--preset", "tiny", "--token-ids", "1,2,3,4", "--max-new-tokens", 2, "--dist-timeout", 20]


def hand_started(rank: int, id_path, tmp_path, attempts: int = 3000, world: int = 2):
    env = {"POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS": str(attempts)}
    return start(*ARGS, "--tp-world", world, "--tp-rank", rank, "--rendezvous-file", id_path, tmp_path=tmp_path, env=env)


def waiting_rank0(id_path, tmp_path):
    """A hand-started rank 0 once it has written its whole --rendezvous-file and waits for rank 1."""
    rank0 = hand_started(0, id_path, tmp_path)
    deadline = time.monotonic() + 30
    while not (id_path.exists() and "end" in id_path.read_text().split()):
        assert time.monotonic() < deadline and rank0.proc.poll() is None, rank0.stderr
        time.sleep(0.05)
    return rank0


def one_line_error(run, rc: int = 2) -> str:
    assert run.wait() == rc, run.stderr
    assert "Traceback" not in run.stderr
    lines = [l for _, l in run.lines if l.startswith("pocketllm: error:")]
    assert len(lines) == 1, run.stderr
    return lines[0].strip()


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("lone_ranks")  # started here, to run beside this test's runs
@pytest.mark.parametrize("where", ["file-store", "env"])
def test_what_the_backend_writes_to_stdout_as_a_rank_joins_is_dropped(where, tmp_path, capfd, monkeypatch):
    """torch 2.10's gloo writes a line per rank to stdout as it connects, where generate's results
    go: a rank joining by either path drops what the join writes there, and only that."""

    def join(*args, **kwargs):
        os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n")

    monkeypatch.setattr(dist, "init_process_group", join)
    os.write(1, b"before\n")
    store = str(tmp_path / "store") if where == "file-store" else None
    rendezvous._join_group("gloo", 0, 1, timedelta(seconds=5), store, None)
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "before\nafter\n"


def test_stale_file_is_refused_then_cleared(tmp_path):
    id_path = tmp_path / "run.id"
    # An earlier run whose rank 0 was killed while it waited for rank 1 leaves the file behind.
    earlier = waiting_rank0(id_path, tmp_path)
    earlier.proc.send_signal(signal.SIGKILL)
    earlier.wait()

    # Rank 1 starts first and waits on the stale file; the new rank 0's refusal stops it too,
    # long before its 30 s wait would run out.
    rank1 = hand_started(1, id_path, tmp_path)
    time.sleep(0.5)
    rank0 = hand_started(0, id_path, tmp_path)
    message = one_line_error(rank0)
    assert "is left from an earlier run" in message and str(id_path) in message, message
    assert "left from an earlier run" in one_line_error(rank1)
    assert rank1.ended - rank0.ended < 5
    for run in (rank0, rank1):
        assert_nothing_left(run)

    # Doing what the message says makes the next run work, and a clean run leaves nothing.
    clear = re.search(r"`([^`]+)`", message).group(1)
    subprocess.run(clear, shell=True, check=True)
    runs = [hand_started(r, id_path, tmp_path) for r in (1, 0)]
    assert [r.wait() for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert "generated_ids=" in runs[1].stdout
    assert not id_path.exists() and not (tmp_path / "run.id.store").exists()


@pytest.mark.timeout(60)
def test_a_rank_whose_command_is_refused_stops_its_rank0_at_once(tmp_path, capsys):
    """Ranks started together: rank 1 refused at start (here by argparse), before its rank 0 has
    made the file, waits for it and tells it; rank 0 stops with rank 1's line at once rather than
    at the end of its 30 s wait."""
    id_path = tmp_path / "run.id"
    rank0 = hand_started(0, id_path, tmp_path)
    refused_at = time.monotonic()
    rc = main_in_process(*ARGS, "--tp-world", 2, "--tp-rank", 1, "--rendezvous-file", id_path, "--max-new-tokens", "many")
    assert rc == 2
    why = capsys.readouterr().err.strip().split(": error: ", 1)[1]
    message = one_line_error(rank0)
    assert message == f"pocketllm: error: rank 1 stopped before it joined at --rendezvous-file {id_path}: {why}"
    assert rank0.ended - refused_at < 10
    assert not id_path.exists() and not (tmp_path / "run.id.store").exists()
    assert_nothing_left(rank0)


def test_a_refusal_after_a_usage_check_is_written_to_a_live_rendezvous_file_only(tmp_path, capsys, no_ranks, monkeypatch):
    """The refusals a command's own checks make are told as argparse's are; a path that holds no
    rendezvous file (none by the end of the bound, or another tool's) is left as it was."""
    monkeypatch.setenv("POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS", "20")  # 0.2 s for a file that never comes
    id_path = tmp_path / "run.id"
    id_path.write_text("pocketllm-rendezvous 1\nnonce=ab12\nworld=2\nhost=h\npid=1\nend\n")
    usage_error_in_process(capsys, *ARGS, "--tp-world", 2, "--tp-rank", 1, "--rendezvous-file", id_path, "--collective", "tcp",
                           expect="--collective 'tcp' is not one of")
    assert id_path.read_text().splitlines()[-1] == "failed=1 --collective 'tcp' is not one of auto, shm, gloo"
    foreign = tmp_path / "notes.txt"
    foreign.write_text("mine\n")
    usage_error_in_process(capsys, *ARGS, "--tp-world", 2, "--tp-rank", 1, "--rendezvous-file", foreign, "--collective", "tcp")
    assert foreign.read_text() == "mine\n"
    usage_error_in_process(capsys, *ARGS, "--tp-world", 2, "--tp-rank", 1, "--rendezvous-file", tmp_path / "absent", "--collective", "tcp")
    assert not (tmp_path / "absent").exists()


def test_a_file_removed_after_it_was_read_is_not_made_again_by_a_refused_rank(tmp_path, monkeypatch):
    """A rank refused after the rendezvous reads FILE, and its rank 0, ending too, removes FILE
    before the refusal is appended: appending must not make FILE again (it held that one line, no
    run removed it, and the next run refused it as not a pocketllm file)."""
    from pocketllm.distributed import rendezvous

    id_path = tmp_path / "run.id"
    read_then_gone = {"nonce": "ab12", "world": "2"}
    monkeypatch.setattr(rendezvous, "_read", lambda path: read_then_gone)
    rendezvous.tell_rank0(str(id_path), 1, "the ranks were started with different settings")
    assert not id_path.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_sigterm_to_a_waiting_rank0_clears_its_file(tmp_path, sig):
    """Unlike SIGKILL above, SIGTERM (or SIGHUP, its terminal closed) can be caught: a
    hand-started rank 0 waiting for the others ends as an interrupted run, and leaves no file to
    refuse the next one."""
    id_path = tmp_path / "run.id"
    rank0 = waiting_rank0(id_path, tmp_path)
    rank0.proc.send_signal(sig)
    assert rank0.wait() == 130, rank0.stderr
    assert "Traceback" not in rank0.stderr and rank0.stderr.strip().splitlines()[-1] == "pocketllm: interrupted", rank0.stderr
    assert not id_path.exists() and not (tmp_path / "run.id.store").exists()
    assert_nothing_left(rank0)


@pytest.mark.timeout(60)
def test_sigterm_to_a_hand_started_rank0_mid_run_ends_it_as_ctrl_c_does(tmp_path):
    """Past the rendezvous too: SIGTERM to rank 0 in the middle of a batch's decode ends it as
    Ctrl-C does (one line, exit 130, its file removed) at once, not after a broadcast to end the
    other rank's follow that would meet rank 1 inside the pass's collective and wait out
    --dist-timeout; rank 1 sees it gone."""
    id_path = tmp_path / "run.id"
    batch = ["--token-ids", "1,2,3", "--token-ids", "4,5,6", "--max-new-tokens", 20000, "--ignore-eos", "--dist-timeout", 30]
    env = {"POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS": "3000"}
    runs = [start("generate", "--preset", "tiny", *batch, "--tp-world", 2, "--tp-rank", r, "--rendezvous-file", id_path, tmp_path=tmp_path, env=env)
            for r in (1, 0)]
    rank1, rank0 = runs
    rank0.line_time("decode step:", timeout=30)
    time.sleep(1.0)
    rank0.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert rank0.wait() == 130, rank0.stderr
    assert time.monotonic() - sent < 10, "rank 0 waited on rank 1 after SIGTERM"
    assert "Traceback" not in rank0.stderr and rank0.last_line == "pocketllm: interrupted", rank0.stderr
    assert rank1.wait() == 1 and "lost its connection to another rank" in rank1.last_line, rank1.stderr
    assert not id_path.exists() and not (tmp_path / "run.id.store").exists()
    for run in runs:
        assert_nothing_left(run)


@pytest.mark.timeout(60)
def test_hand_started_ranks_with_different_settings_stop_naming_them(tmp_path):
    """Each hand-started rank plans from its own command line: one that steers the run otherwise
    than rank 0's (here --max-new-tokens and --collective) is named on every rank, before any
    collective of the run (the ranks would part ways mid-run, or wait out --dist-timeout)."""
    id_path = tmp_path / "run.id"
    env = {"POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS": "3000"}
    common = ["generate", "--preset", "tiny", "--token-ids", "1,2,3", "--tp-world", 2, "--rendezvous-file", id_path, "--dist-timeout", 20]
    rank1 = start(*common, "--tp-rank", 1, "--max-new-tokens", 3, "--collective", "shm", "--pin-slices", 2, tmp_path=tmp_path, env=env)
    rank0 = start(*common, "--tp-rank", 0, "--max-new-tokens", 12, "--collective", "gloo", "--logits-out", tmp_path / "l.safetensors", tmp_path=tmp_path, env=env)
    for run in (rank0, rank1):
        message = one_line_error(run)
        assert message.startswith("pocketllm: error: the ranks were started with different settings: "), message
        # Named as the flags are (a plan field named otherwise too); rank 0's own --logits-out (an
        # output) is no difference.
        for said in ("--max-new-tokens 3 on rank 1, 12 on rank 0", "--collective (or POCKETLLM_COLLECTIVE) shm on rank 1, gloo on rank 0",
                     "--pin-slices 2 on rank 1, (not given) on rank 0"):
            assert said in message, message
        assert "--logits-out" not in message
        assert_nothing_left(run)
    assert not id_path.exists()


@pytest.fixture(scope="module")
def lone_ranks(tmp_path_factory):
    """The runs below that end on their own at the rendezvous, each one process that stops there:
    a rank 1 whose rank 0 never comes, a rank 0 whose directory is not writable, and a torchrun
    rank 0 whose MASTER_PORT is taken. Each spends about a second of one core starting torch, so
    they are started together, at the module's first test (whose own runs leave a core idle for
    seconds, waiting on one rank alone), each test checking its own from its recorded exit."""
    tmp_path = tmp_path_factory.mktemp("lone")
    if os.geteuid() == 0:
        # Permission bits do not stop root; sysfs refuses new files to everyone.
        directory = "/sys"
    else:
        directory = tmp_path / "ro"
        directory.mkdir(mode=0o500)
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = busy.getsockname()[1]
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    runs = {
        "no-rank0": hand_started(1, tmp_path / "run.id", tmp_path, attempts=20),
        "unwritable": (hand_started(0, f"{directory}/run.id", tmp_path), directory),
        "port-in-use": (start(*ARGS, tmp_path=tmp_path, env=torchrun), port),
    }
    try:
        yield runs
    finally:
        busy.close()
        for run in (runs["no-rank0"], runs["unwritable"][0], runs["port-in-use"][0]):
            if run.proc.poll() is None:
                run.proc.kill()
                run.wait()


@pytest.mark.timeout(30)
def test_missing_rank0_is_waited_for_a_bounded_time(lone_ranks):
    rank1 = lone_ranks["no-rank0"]
    message = one_line_error(rank1)
    assert "no rank 0 created --rendezvous-file" in message and "within 0.2 s" in message, message
    assert rank1.ended - rank1.started < 15
    assert_nothing_left(rank1)


@pytest.mark.timeout(30)
def test_unwritable_directory_is_named(lone_ranks):
    run, directory = lone_ranks["unwritable"]
    message = one_line_error(run)
    assert f"directory {directory} is not writable" in message, message
    assert_nothing_left(run)


@pytest.mark.timeout(30)
def test_port_in_use_is_named(lone_ranks):
    run, port = lone_ranks["port-in-use"]
    message = one_line_error(run)
    assert f"MASTER_PORT {port} is already in use" in message, message
    assert_nothing_left(run)


def test_private_dirs_of_dead_launchers_are_removed(tmp_path):
    from pocketllm.distributed.rendezvous import private_dir

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"pocketllm-rdzv-{dead.pid}-abc123"
    live = tmp_path / f"pocketllm-rdzv-{os.getpid()}-def456"
    other = tmp_path / f"pocketllm-rdzv-{dead.pid}"  # not a name private_dir makes: left alone
    for d in (stale, live, other):
        d.mkdir()
        (d / "store").write_text("x")
    made = private_dir(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()
    assert os.path.basename(made).startswith(f"pocketllm-rdzv-{os.getpid()}-")
    assert os.stat(made).st_mode & 0o777 == 0o700


def test_a_device_backends_group_reduces_the_commands_cpu_tensors(tmp_path):
    # The commands reduce host numbers (timing maxima, every rank's RSS) over the device group.
    # Stand-in for NCCL on a CPU-only machine: the spec pocketllm builds, with gloo in NCCL's
    # place; a group bound to cuda alone would refuse a CPU tensor. (HCCL's spec names the npu
    # device, which torch knows only with torch_npu installed.)
    spec = backend_spec("nccl").replace(":nccl", ":gloo")
    assert spec != "gloo"
    dist.init_process_group(spec, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        t = torch.ones(2, dtype=torch.float64)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("text", ["100,264,4628,286\n", "100,264,4628,286"], ids=["a-line", "without-its-newline"])
def test_a_file_of_the_users_own_is_refused_never_written_to_nor_to_be_removed(text, tmp_path, capsys, no_ranks):
    """--rendezvous-file naming a file that is not pocketllm's (a token-ids file, by mistake):
    rank 0 and the others refuse it, leave it as it was, and do not advise removing it."""
    mine = tmp_path / "ids.txt"
    mine.write_text(text)
    for rank in (0, 1):
        line = usage_error_in_process(capsys, *ARGS, "--tp-world", 2, "--tp-rank", rank, "--rendezvous-file", mine, "--device", "cpu",
                                      expect=f"--rendezvous-file {mine} exists and is not a pocketllm rendezvous file; give a path that does not exist")
        assert "rm -f" not in line
        assert mine.read_text() == text


@pytest.mark.timeout(60)
def test_a_rank0_whose_command_is_refused_stops_the_others_at_once(tmp_path, capsys):
    """Ranks started together, rank 0 refused at start (here by argparse): it makes the file saying
    so, the others stop with its line at once rather than wait out their bound for a file that
    never comes, and the file is gone once they have read it."""
    id_path = tmp_path / "run.id"
    rank1 = hand_started(1, id_path, tmp_path)
    refused_at = time.monotonic()
    rc = main_in_process(*ARGS, "--tp-world", 2, "--tp-rank", 0, "--rendezvous-file", id_path, "--max-new-tokens", "many")
    assert rc == 2
    why = capsys.readouterr().err.strip().splitlines()[0].split(": error: ", 1)[1]
    message = one_line_error(rank1)
    assert message == f"pocketllm: error: rank 0 stopped before the rendezvous at --rendezvous-file {id_path}: {why}"
    assert rank1.ended - refused_at < 10
    assert not id_path.exists() and not (tmp_path / "run.id.store").exists()
    assert_nothing_left(rank1)

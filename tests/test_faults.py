"""A dead or hung rank ends the whole run: the launcher exits with one line naming the first rank
that failed and how, within seconds, and no process of the run is left. Faults are injected with
POCKETLLM_FAULT (see pocketllm/fault_injection.py).

Every run is started with conftest.start, which tags it so that all of its processes (even ones
the launcher lost) are found by scanning /proc, and which takes each run's exit time as it
happens: the hung-rank run, which mostly waits out its timeout, runs beside the dead-rank runs.
So a dead-rank run checks that it leaves no shared-memory segment behind by the segments whose
creator is gone (stale_segments): a run still going holds its own in /dev/shm for a moment while
its ranks set up."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import Run, assert_nothing_left, kill_tagged, shm_segments, stale_segments, start, tagged
from pocketllm.errors import UsageError
from pocketllm.fault_injection import parse_fault

# The bound from a rank's death to the launcher's exit.
STOP_BOUND_S = 5.0
HANG_TIMEOUT_S = 2
PROMPT = ",".join(str((7 * i + 3) % 997) for i in range(40))


def rdzv_dirs(run: Run) -> list[Path]:
    """The launcher's private rendezvous directories under the run's TMPDIR."""
    return list(run.tmpdir.glob("pocketllm-rdzv-*"))


def generate_args(world: int, *extra) -> list:
    return ["generate", "--preset", "tiny", "--tp-world", world, "--token-ids", PROMPT, "--max-new-tokens", 8, *extra]


FAULTS = [
    # (world, rank, at, kind): every kind and every point, on rank 1 of 2 and rank 3 of 4; each
    # launch costs seconds, so no kind or point is run twice at one world size.
    (2, 1, "prefill", "raise"),
    (2, 1, "load", "kill"),
    (2, 1, "decode", "exit"),
    (4, 3, "decode", "kill"),
]
EXPECTED = {
    "exit": r"rank {rank} failed \(exit code 3\)$",
    "kill": r"rank {rank} failed \(killed by signal SIGKILL\)$",
    "raise": r"rank {rank} failed \(exit code 1\): RuntimeError: injected fault \(POCKETLLM_FAULT\) rank {rank} at {at}: raise$",
}


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory):
    """The hung-rank run, started at the module's first test: it spends seconds waiting out its
    collective timeout, beside the dead-rank runs; test_hung_rank_ends_in_a_collective_timeout
    checks it."""
    run = start(*generate_args(2, "--dist-timeout", HANG_TIMEOUT_S), tmp_path=tmp_path_factory.mktemp("hung"),
                env={"POCKETLLM_FAULT": "rank=1,at=decode,kind=hang"})
    yield run
    if run.proc.poll() is None:
        run.proc.kill()
    kill_tagged(run.tag)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,rank,at,kind", FAULTS, ids=lambda v: str(v))
def test_dead_rank_stops_the_run(world, rank, at, kind, tmp_path, hung_run):
    segments = stale_segments()
    run = start(*generate_args(world, "--dist-timeout", 30), tmp_path=tmp_path, env={"POCKETLLM_FAULT": f"rank={rank},at={at},kind={kind}"})
    rc = run.wait()
    died = run.line_time("injected fault")
    assert rc == 1, run.stderr
    assert re.search("^pocketllm: error: " + EXPECTED[kind].format(rank=rank, at=at), run.last_line), run.stderr
    assert run.ended - died < STOP_BOUND_S, f"{run.ended - died:.1f} s from the fault to the launcher's exit"
    assert "generated_ids" not in run.stdout
    assert_nothing_left(run)
    assert rdzv_dirs(run) == [], "the private rendezvous directory was not removed"
    # Every run here sums through shared memory (auto on one host); its segment must be gone too.
    assert stale_segments() == segments


@pytest.mark.timeout(60)
def test_hung_rank_ends_in_a_collective_timeout(hung_run):
    run = hung_run
    rc = run.wait()
    hung = run.line_time("injected fault")
    assert rc == 1, run.stderr
    assert re.search(
        rf"^pocketllm: error: rank 0 failed \(exit code 1\): a collective it waited for in decode pass \d+ timed out after {HANG_TIMEOUT_S} s",
        run.last_line,
    ), run.stderr
    assert "Traceback" not in run.stderr
    # The wait that timed out was the shared-memory all-reduce's, worded as gloo's would be.
    assert "all-reduce: shm" in run.stderr
    # Rank 0 may have started waiting a little before rank 1 printed its note.
    assert HANG_TIMEOUT_S - 1 < run.ended - hung < HANG_TIMEOUT_S + STOP_BOUND_S
    assert_nothing_left(run)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_signal_to_the_launcher_ends_every_rank(sig, tmp_path):
    # A hung rank with a long timeout keeps the run alive until the signal.
    segments = shm_segments()
    run = start(*generate_args(2, "--dist-timeout", 60), tmp_path=tmp_path, env={"POCKETLLM_FAULT": "rank=1,at=prefill,kind=hang"})
    run.line_time("injected fault")
    (rdzv,) = rdzv_dirs(run)
    assert rdzv.stat().st_mode & 0o777 == 0o700
    assert len(tagged(run.tag)) == 3
    sent = time.monotonic()
    run.proc.send_signal(sig)
    rc = run.wait()
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
        # Orphaned ranks see their parent die (PR_SET_PDEATHSIG) and go with it.
        assert_nothing_left(run, within=STOP_BOUND_S)
        assert shm_segments() == segments
        # A launcher killed outright leaves its directory; the next launch removes it.
        assert rdzv_dirs(run) == [rdzv]
        after = start(*generate_args(2), tmp_path=tmp_path, env={"TMPDIR": str(run.tmpdir)})
        assert after.wait() == 0, after.stderr
        assert_nothing_left(after)
        assert rdzv_dirs(run) == []
        return
    assert rc == 128 + sig, run.stderr
    assert run.last_line == f"pocketllm: error: got {sig.name}; stopped every rank"
    assert run.ended - sent < STOP_BOUND_S
    assert_nothing_left(run)
    assert rdzv_dirs(run) == []
    assert shm_segments() == segments


@pytest.mark.parametrize(
    "spec,message",
    [
        ("rank=1,at=load", "missing kind"),
        ("rank=2,at=load,kind=kill", "rank 2 is outside 0..1"),
        ("rank=0,at=sample,kind=kill", "at='sample' is not one of load, prefill, decode"),
        ("rank=0,at=load,kind=segv", "kind='segv' is not one of exit, kill, hang, raise"),
        ("rank=x,at=load,kind=kill", "rank 'x' is not an integer"),
        ("1,load,kill", "expected rank=R,at=load|prefill|decode"),
    ],
)
def test_bad_fault_spec_is_a_usage_error(spec, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_fault(spec, world=2)


@pytest.mark.parametrize(
    "exc, kind",
    [
        (dist.DistNetworkError("Connection reset"), "peer"),
        # Gloo's own messages (torch 2.13), raised as plain RuntimeErrors.
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"), "timeout"),
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16790"), "peer"),
        (RuntimeError("shape mismatch: timeout of 3 in the config"), None),
        (ValueError("timed out"), None),
    ],
    ids=["network-error-type", "gloo-timeout", "gloo-peer", "not-a-collective", "not-a-collective-type"],
)
def test_collective_failures_are_classified(exc, kind):
    from pocketllm.rank_failures import collective_failure

    assert collective_failure(exc) == kind


# torch's message for a CUDA allocation refused (2.13), its advice on allocator settings last.
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. "
            "Including non-PyTorch memory, this process has 78.10 GiB memory in use. If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_an_allocation_refused_is_named_with_what_was_free():
    import torch

    from pocketllm.rank_failures import out_of_memory

    line = out_of_memory(torch.OutOfMemoryError(CUDA_OOM))
    assert line.startswith("out of memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
                           "of which 1.06 GiB is free): ") and "PYTORCH_CUDA_ALLOC_CONF" not in line
    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**46, dtype=torch.uint8)  # 64 TiB: the CPU allocator refuses it at once
    assert out_of_memory(refused.value).startswith("out of memory (the host refused 65536.00 GiB): ")
    assert out_of_memory(RuntimeError("shape mismatch")) is None


def test_a_rank_out_of_memory_ends_the_run_with_one_line(monkeypatch, capsys):
    """Where its weights or KV cache do not fit: exit 1 and one line saying what was free, not a
    traceback (TP=1 runs the rank in the command's own process; a launcher prints the same line)."""
    import torch

    from conftest import main_in_process
    from pocketllm.engine import runner

    def refuse(*args, **kwargs):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(runner, "load_weights", refuse)
    assert main_in_process("bench", "--preset", "tiny", "--prompt-tokens", "8", "--max-new-tokens", "2") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pocketllm: error: rank 0: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB."), err
    assert not any("Traceback" in line for line in err), err


def test_an_aborted_rank_is_described_as_the_watchdog_would_have_it():
    """Only where a watchdog runs: on gloo an abort is the process's own (a failed allocation)."""
    from pocketllm.rank_failures import describe_exit

    for backend in ("nccl", "hccl"):
        assert "watchdog" in describe_exit(-signal.SIGABRT, backend) and "NCCL" in describe_exit(-signal.SIGABRT, backend)
    assert describe_exit(-signal.SIGABRT, "gloo") == "killed by signal SIGABRT"
    assert describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"


@pytest.mark.parametrize(
    "codes, reports, named",
    [
        # Rank 0 lost its peer and exited first; rank 1 raised and broke the group: rank 1.
        ([1, None], {0: {"kind": "peer", "time": 1.0}, 1: {"kind": "exception", "time": 2.0}}, 1),
        # A rank killed by a signal leaves no report and is named over a timed-out peer.
        ([1, -9], {0: {"kind": "timeout", "time": 1.0}, 1: None}, 1),
        # Two failures of their own: the earlier report.
        ([1, 1], {0: {"kind": "exception", "time": 2.0}, 1: {"kind": "usage", "time": 1.0}}, 1),
        # A timeout is more likely its own failure than a lost peer.
        ([1, 1], {0: {"kind": "peer", "time": 1.0}, 1: {"kind": "timeout", "time": 2.0}}, 1),
    ],
    ids=["raiser-over-lost-peer", "signal-over-timeout", "earlier-report", "timeout-over-peer"],
)
def test_the_rank_named_is_the_one_least_likely_to_have_failed_because_of_another(codes, reports, named):
    from pocketllm.rank_failures import first_failure

    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    assert first_failure(codes, failed, reports) == named


@pytest.mark.parametrize("backend, failed, called", [
    ("cpu:gloo,cuda:nccl", True, "abort"),
    ("cpu:gloo,npu:hccl", True, "abort"),
    ("cpu:gloo,cuda:nccl", False, "destroy"),
    ("cpu:gloo,cuda:gloo", True, "destroy"),
])
def test_a_failed_rank_aborts_a_group_whose_destroy_would_wait_for_its_collectives(backend, failed, called, monkeypatch):
    """NCCL's (and HCCL's) destroy waits for the collectives in flight: after a failure its peers
    never match them, so the rank would wait for the watchdog. It aborts the group there instead;
    gloo's peers see a destroyed rank leave at once, and a run that ended well destroys it."""
    from torch.distributed import distributed_c10d

    from pocketllm.distributed import rendezvous

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    rendezvous.leave_group(failed=failed)
    assert calls == [called]

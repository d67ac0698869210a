"""The shared-memory all-reduce (pocketllm/distributed/shm): the C reduce against its torch
reference; on real groups of 2 and 4 ranks, every dtype and size (odd ones, ones beyond the shared
buffer, back-to-back calls) against the fp32 sum rounded once, fp32 bit for bit against gloo at
TP=2, the overlapped path's async slices (and first, on gloo's own async all-reduce, test_overlap's
check), a peer that never arrives and one that dies; and from the command line, the fallback
without a compiler (the flag, the choice in --json and /dev/shm left as it was found:
test_cpu_pinning's TP=2 bench runs)."""

from __future__ import annotations

import json
import os
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import end_process, free_port, shm_segments, start, start_ranks, usage_error_in_process, usage_line
from test_overlap import check_overlapped_equals_serial
from pocketllm.distributed import collective
from pocketllm.distributed.shm import segment
from pocketllm.distributed.shm.collective import CHUNK_BYTES, ONE_STEP_BYTES, ShmCollectiveError
from pocketllm.distributed.shm.reduce import reduce_sum_, reduce_sum_reference_

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit, except that any NaN matches any NaN (torch's own conversions disagree on
    which NaN bf16 gets)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), what
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan]), what


def _values(n: int, seed: int, dtype) -> torch.Tensor:
    """Random values over 20 binades, so sums round in every way."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 2.0 ** torch.randint(-10, 10, (n,), generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_c_reduce_matches_the_reference(dtype, world):
    for n in (1, 7, 513, 10007):
        parts = [_values(n, 10 * n + r, dtype) for r in range(world)]
        if n > 10:
            # Specials: NaN, both infinities (their sum is NaN), -0 + -0, the largest finite value
            # twice (overflows), and a subnormal.
            parts[0][:6] = torch.tensor([float("nan"), float("inf"), float("inf"), -0.0, torch.finfo(dtype).max, torch.finfo(dtype).tiny / 4])
            parts[1][:6] = torch.tensor([1.0, 1.0, float("-inf"), -0.0, torch.finfo(dtype).max, 0.0])
            for p in parts[2:]:
                p[:6] = torch.tensor([0.0, 0.0, 0.0, -0.0, 0.0, 0.0])
        got, want = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        _assert_same(reduce_sum_(got, parts), reduce_sum_reference_(want, parts), f"{dtype} world={world} n={n}")


# Sizes in elements per dtype: tiny and odd ones, the largest one-step payload and one past it,
# and more than three of the segment's chunks with an odd tail.
def _sizes(dtype) -> list[int]:
    es = dtype.itemsize
    return [1, 3, 1023, ONE_STEP_BYTES // es, ONE_STEP_BYTES // es + 1, 3 * CHUNK_BYTES // es + 4097]


def _check_sums(rank: int, world: int) -> None:
    """Every dtype and size, back to back, each against the fp32 sum of every rank's input in rank
    order rounded once (the reference), bit for bit."""
    for rnd in range(2):
        for dtype in DTYPES:
            for n in _sizes(dtype):
                seed = 1000 * rnd + n
                t = _values(n, seed * 16 + rank, dtype)
                collective.start_all_reduce(t).wait()
                want = reduce_sum_reference_(torch.empty(n, dtype=dtype), [_values(n, seed * 16 + r, dtype) for r in range(world)])
                _assert_same(t, want, f"TP={world} {dtype} n={n}")
    # Many small calls in a row, each with values the previous one did not have.
    for i in range(200):
        t = torch.full((5,), float(rank + i), dtype=torch.float32)
        collective.start_all_reduce(t).wait()
        assert t.float().tolist() == [float(sum(r + i for r in range(world)))] * 5, i


def _check_fp32_equals_gloo(rank: int) -> None:
    for n in _sizes(torch.float32):
        x = _values(n, 77 + n + rank, torch.float32)
        by_gloo = x.clone()
        dist.all_reduce(by_gloo)
        collective.start_all_reduce(x).wait()
        assert torch.equal(_bits(x), _bits(by_gloo)), n


def _check_overlapped(rank: int, world: int) -> None:
    """The overlapped projection's async slices on shm: each call hands back a finished handle,
    and the result is the reference sum of every rank's partial products, slice by slice."""
    from pocketllm.distributed.accounting import COUNTER
    from pocketllm.distributed.overlap import projection_all_reduce_overlapped, slice_bounds
    from pocketllm.distributed.state import all_reduce_async_
    from pocketllm.ops.registry import default_kernels

    assert all_reduce_async_(torch.ones(3), "mlp.down").is_completed()
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(5 + rank)
        x, w = torch.randn(37, 24, generator=g).to(dtype), torch.randn(40, 24, generator=g).to(dtype)
        for slices in (1, 2, 3, 4):
            COUNTER.reset()
            out = projection_all_reduce_overlapped(x, default_kernels(w), slices, "mlp.down")
            assert COUNTER.total == slices
            want = torch.empty_like(out)
            for lo, hi in slice_bounds(37, slices):
                partial = torch.empty(hi - lo, 40, dtype=dtype)
                default_kernels(w)(x[lo:hi], out=partial)
                parts = [torch.empty_like(partial) for _ in range(world)]
                dist.all_gather(parts, partial)
                reduce_sum_reference_(want[lo:hi], parts)
            _assert_same(out, want, f"TP={world} {dtype} slices={slices}")
    # A strided view is summed through a contiguous copy; a dtype the helper lacks goes to gloo.
    base = torch.arange(24, dtype=torch.float32).view(4, 6) * (rank + 1)
    view = base[:, ::2]
    collective.start_all_reduce(view).wait()
    assert torch.equal(view, torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2] * sum(range(1, world + 1)))
    d = torch.full((3,), float(rank), dtype=torch.float64)
    collective.start_all_reduce(d).wait()
    assert d.tolist() == [float(sum(range(world)))] * 3
    # The head's logits gather as a sum over zeros: the concatenation, bit for bit, specials kept.
    from pocketllm.distributed.state import all_gather_cat

    part = _values(1001, 300 + rank, torch.float32)[None]
    part[0, :2] = torch.tensor([float("inf"), -1e-40])
    gathered = all_gather_cat(part)
    want = torch.cat([_values(1001, 300 + r, torch.float32)[None] for r in range(world)], dim=-1)
    for r in range(world):
        want[0, r * 1001 : r * 1001 + 2] = torch.tensor([float("inf"), -1e-40])
    _assert_same(gathered, want, f"gather TP={world}")


def _check_lost_peers(rank: int) -> None:
    """Rank 0 waits for a rank 1 that never calls, then for one that has exited."""
    dist.barrier()
    if rank == 1:
        # Exit as a crash would, once rank 0 has timed out, leaving a zombie until reaped.
        dist.barrier()
        os._exit(0)
    timeout_s = 0.25
    collective._shm.timeout_s = timeout_s
    t0 = time.monotonic()
    with pytest.raises(ShmCollectiveError) as caught:
        collective.start_all_reduce(torch.ones(8))
    assert caught.value.collective_kind == "timeout"
    # Not before the timeout; the upper bound only tells a timeout from a hang (a busy machine
    # may run the waiting rank late).
    assert timeout_s <= time.monotonic() - t0 < 5.0
    dist.barrier()
    collective._shm.timeout_s = 60.0
    t0 = time.monotonic()
    with pytest.raises(ShmCollectiveError) as caught:
        collective.start_all_reduce(torch.ones(8))
    assert caught.value.collective_kind == "peer"
    assert time.monotonic() - t0 < 5.0
    os._exit(0)


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    from pocketllm.distributed.state import set_tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    set_tp(rank, world)
    # Before the shared-memory all-reduce is set up, the overlapped projection's slices go through
    # gloo's own async all-reduce: test_overlap's check, in the same group.
    check_overlapped_equals_serial(rank, world)
    collective.setup("shm", "gloo", rank, world, timeout_s=60.0)
    assert collective.name() == "shm"
    _check_sums(rank, world)
    _check_overlapped(rank, world)
    if world == 2:
        _check_fp32_equals_gloo(rank)
        _check_lost_peers(rank)
    collective.close()
    dist.destroy_process_group()
    end_process()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"tp{w}")
def test_shm_all_reduce_on_a_real_group(world):
    before = shm_segments()
    start_ranks(_worker, world, world, free_port())
    assert shm_segments() == before


def test_collective_choice_errors(capsys, no_ranks, monkeypatch):
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", 2, "--collective", "fast", expect="--collective 'fast' is not one of auto, shm, gloo")
    monkeypatch.setenv("POCKETLLM_COLLECTIVE", "tcp")
    usage_error_in_process(capsys, "allreduce", expect="POCKETLLM_COLLECTIVE='tcp' is not one of auto, shm, gloo")
    # A refusal names the choice as it was asked: here by the variable, not a flag the user never gave.
    from pocketllm import compiled

    monkeypatch.setenv("POCKETLLM_COLLECTIVE", "shm")
    monkeypatch.setattr(compiled, "compiler", lambda: None)
    line = usage_error_in_process(capsys, "allreduce", expect="POCKETLLM_COLLECTIVE=shm: no C compiler")
    assert "--collective" not in line
    usage_error_in_process(capsys, "allreduce", "--collective", "shm", expect="--collective shm: no C compiler")


def test_a_segment_left_by_a_dead_rank_0_is_removed_by_the_next_run():
    # A pid above the kernel's pid_max never belongs to a live process.
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1
    stale = os.path.join(segment.SHM_DIR, f"{segment.PREFIX}{dead}-{'0' * 32}")
    open(stale, "w").close()
    mine = segment.create(4096)
    try:
        assert not os.path.exists(stale)
        assert os.stat(mine.path).st_mode & 0o777 == 0o600
    finally:
        segment.unlink(mine.path)
        mine.close()


@pytest.mark.timeout(120)
def test_without_a_compiler_auto_falls_back_to_gloo_and_shm_is_refused(tmp_path):
    # No compiler on PATH and an empty cache: auto notes it in one line and runs on gloo; shm
    # asked for by name is refused (by the launcher, before its ranks start). The two runs share
    # nothing, so they run side by side.
    no_compiler = {"PATH": str(tmp_path), "POCKETLLM_CACHE_DIR": str(tmp_path / "cache"), "CC": ""}
    out = tmp_path / "r.json"
    bench = start("bench", "--preset", "tiny", "--tp-world", 2, "--prompt-tokens", 8, "--max-new-tokens", 1, "--json", out, tmp_path=tmp_path, env=no_compiler)
    refused = start("allreduce", "--tp-world", 2, "--max-bytes", "2K", "--collective", "shm", tmp_path=tmp_path, env=no_compiler)
    assert bench.wait() == 0, bench.stderr
    assert json.loads(out.read_text())["settings"]["collective"] == "gloo"
    notes = [line for line in bench.stderr.splitlines() if line.startswith("all-reduce:")]
    assert notes == ["all-reduce: gloo (shm unavailable: no C compiler (cc, gcc or clang; or $CC) to build allreduce.c)"]
    usage_line(refused.wait(), refused.stderr, ["--collective shm: no C compiler"])


def test_what_the_ranks_would_refuse_about_shm_is_refused_before_they_start(monkeypatch):
    from pocketllm import compiled
    from pocketllm.distributed.collective_choice import check_choice
    from pocketllm.errors import UsageError

    with pytest.raises(UsageError, match=re.escape("--collective shm needs CPU ranks (gloo); this run's backend is nccl")):
        check_choice("shm", "nccl")
    check_choice("auto", "nccl")
    monkeypatch.setattr(compiled, "compiler", lambda: "/usr/bin/cc")
    check_choice("shm", "gloo")
    monkeypatch.setattr(compiled, "compiler", lambda: None)
    with pytest.raises(UsageError, match=re.escape("--collective shm: no C compiler (cc, gcc or clang; or $CC) to build allreduce.c")):
        check_choice("shm", "gloo")
    check_choice("auto", "gloo")  # auto falls back to gloo on the ranks, saying why

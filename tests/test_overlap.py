"""The overlapped projection and its slice policy (seed sections 1 and 4): the sliced path gives
the serial path's result, the rule picks the seed's counts, a pin that cannot be served falls
back to serial, bad knobs are one line and exit 2, and slice i's all-reduce is issued before
GEMM i+1 runs. On real gloo groups of 2 and 4 (check_overlapped_equals_serial, run inside
test_shm_allreduce's groups) the sliced path equals the serial one. (The collectives a whole pass issues: test_cpu_pinning's TP=2 bench runs.)"""

from __future__ import annotations

import pytest
import torch

from conftest import main_in_process, usage_error_in_process
from numerics import rel_err
from pocketllm.distributed.accounting import COUNTER
from pocketllm.distributed.overlap import is_serial, projection_all_reduce_overlapped, slice_bounds
from pocketllm.distributed.policy import PinnedPolicy, RulePolicy, comm_overlap_slices_for_rows, resolve_policy
from pocketllm.distributed.state import set_tp
from pocketllm.errors import UsageError
from pocketllm.ops.registry import default_kernels

SLICES = (1, 2, 3, 4, 8)
# Uneven on purpose: not divisible by 2, 3, 4 or 8, and 3 is fewer rows than 4 or 8 slices.
ROWS = (3, 13, 37)
# Scale-relative: max |overlapped - serial| <= TOL * max |serial|. Slicing changes which rows
# each GEMM call sees and how the all-reduce chunks its buffer, so sums may be ordered differently:
# measured at most 1.9e-7 (fp32, ~1.6 eps) and exactly one bf16 ulp at the top magnitude
# (2^-7 relative, TP=4). The bounds are 1e-6 (~8 fp32 eps) and 2^-6 (two bf16 ulps).
TOL = {torch.float32: 1e-6, torch.bfloat16: 2**-6}


def check_overlapped_equals_serial(rank: int, world: int) -> None:
    """On one rank of a real gloo group of `world` (the all-reduces gloo's own async ones): the
    sliced path gives the serial path's result, with one collective per slice. Run inside
    test_shm_allreduce's groups of 2 and 4, before they set up the shared-memory all-reduce, so
    that each world size is started once."""
    for dtype, tol in TOL.items():
        for rows in ROWS:
            gen = torch.Generator().manual_seed(100 * rows + rank)
            x = torch.randn(rows, 24, generator=gen).to(dtype)
            w = torch.randn(40, 24, generator=gen).to(dtype)
            serial = projection_all_reduce_overlapped(x, default_kernels(w), 1, "mlp.down")
            # The exact sum of every rank's partial product, as the reference both must match.
            exact = torch.zeros(rows, 40, dtype=torch.float64)
            for r in range(world):
                g = torch.Generator().manual_seed(100 * rows + r)
                xr = torch.randn(rows, 24, generator=g).to(dtype)
                wr = torch.randn(40, 24, generator=g).to(dtype)
                exact += xr.double() @ wr.double().t()
            # The serial path rounds each rank's product and each partial sum once more.
            assert rel_err(serial, exact) <= 4 * tol
            for slices in SLICES:
                COUNTER.reset()
                out = projection_all_reduce_overlapped(x, default_kernels(w), slices, "mlp.down")
                assert out.dtype == dtype and out.shape == (rows, 40)
                assert rel_err(out, serial) <= tol, f"TP={world} {dtype} rows={rows} slices={slices}"
                # One collective per slice, or one when the path falls back to serial.
                assert COUNTER.total == (1 if is_serial(rows, slices) else slices)


def test_slice_bounds_cover_uneven_rows():
    assert slice_bounds(13, 4) == [(0, 4), (4, 7), (7, 10), (10, 13)]
    assert slice_bounds(8, 8) == [(i, i + 1) for i in range(8)]


def test_rule_table():
    assert {r: comm_overlap_slices_for_rows(r) for r in (512, 1024, 2048, 4096, 8192)} == {512: 1, 1024: 1, 2048: 2, 4096: 4, 8192: 4}
    assert comm_overlap_slices_for_rows(8192, ceiling=8) == 8
    assert comm_overlap_slices_for_rows(8192, ceiling=1) == 1
    assert comm_overlap_slices_for_rows(8192, ceiling=0) == 1
    # Decode rows come out serial.
    assert RulePolicy().slices_for_rows(1) == 1


def test_pin_falls_back_to_serial_when_rows_are_fewer_than_slices():
    set_tp(0, 2)
    try:
        assert is_serial(3, 8) and is_serial(1, 4) and not is_serial(8, 8) and not is_serial(13, 3)
    finally:
        set_tp(0, 1)
    # At world size 1 there is nothing to overlap.
    assert is_serial(4096, 4)
    # A pin reports what runs: 1 below its slice count, and for a pin of 0 (serial) at any rows.
    assert [PinnedPolicy(4).slices_for_rows(r) for r in (3, 4, 512)] == [1, 4, 4]
    assert [PinnedPolicy(0).slices_for_rows(r) for r in (1, 512)] == [1, 1]


def test_pin_overrides_ceiling_with_a_note():
    choice = resolve_policy(pin="2", ceiling="8", env={})
    assert isinstance(choice.policy, PinnedPolicy) and choice.policy.slices == 2
    assert "overrides" in choice.note
    assert resolve_policy(env={"POCKETLLM_PIN_SLICES": "3"}).policy.slices == 3
    assert resolve_policy(env={"POCKETLLM_COMM_OVERLAP_SLICES": "8"}).policy.ceiling == 8
    with pytest.raises(UsageError, match="non-negative integer"):
        resolve_policy(pin="-1", env={})


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--pin-slices", "-1"], {}, "--pin-slices must be a non-negative integer, got -1"),
        (["--comm-overlap-slices", "four"], {}, "--comm-overlap-slices must be a non-negative integer, got 'four'"),
        ([], {"POCKETLLM_COMM_OVERLAP_SLICES": "abc"}, "POCKETLLM_COMM_OVERLAP_SLICES must be a non-negative integer, got 'abc'"),
        ([], {"POCKETLLM_PIN_SLICES": "1.5"}, "POCKETLLM_PIN_SLICES must be a non-negative integer, got '1.5'"),
        (["--rows", "0"], {}, "--rows: 0 must be a positive integer"),
    ],
)
def test_knob_errors_exit_2(args, env, message, capsys, no_ranks, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = usage_error_in_process(capsys, "policy", *args)
    assert line == "pocketllm: error: " + message


def test_policy_command_prints_the_rule(capsys):
    def policy(*argv):
        assert main_in_process("policy", *argv) == 0
        return capsys.readouterr()

    assert policy().out.split() == ["rows=512", "slices=1", "rows=1024", "slices=1", "rows=2048", "slices=2", "rows=4096", "slices=4"]
    assert policy("--rows", "8192", "--comm-overlap-slices", "8").out.strip() == "rows=8192 slices=8"
    pinned = policy("--rows", "2,512,8192", "--pin-slices", "3", "--comm-overlap-slices", "8")
    # Fewer rows than the pin run serial, and policy says so.
    assert pinned.out.split() == ["rows=2", "slices=1", "rows=512", "slices=3", "rows=8192", "slices=3"]
    assert "overrides" in pinned.err


class _RecordedWork:
    """A work handle that sums on wait, as two ranks holding the same partial product would."""

    def __init__(self, t, log, index):
        self.t, self.log, self.index = t, log, index

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        self.log.append(("wait", self.index))
        self.t.mul_(2)


@pytest.mark.parametrize("rows,slices", [(13, 4), (37, 3), (8, 8)])
def test_slice_i_all_reduce_is_issued_before_gemm_i_plus_1(rows, slices, monkeypatch):
    """The overlap's point: slice i's all-reduce starts right after its GEMM, on the rows that GEMM
    wrote (in place, in the one output buffer), before GEMM i+1 runs; the waits come only after
    the last GEMM. Recorded at the real call sites with a stand-in collective on a TP=2 state."""
    from pocketllm.distributed import collective

    log, issued = [], []

    class Logged:
        """The projection's kernels, each call logged."""

        def __init__(self, real):
            self.real, self.out_features = real, real.out_features

        def __call__(self, x, out=None):
            log.append(("gemm", len(issued)))
            return self.real(x, out)

    def start_all_reduce(t):
        i = len(issued)
        issued.append(t)
        log.append(("reduce", i))
        # The slice is already its GEMM's result when its all-reduce starts.
        lo, hi = bounds[i]
        assert torch.equal(t, x[lo:hi] @ w.t())
        return _RecordedWork(t, log, i)

    monkeypatch.setattr(collective, "start_all_reduce", start_all_reduce)
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 24, generator=gen), torch.randn(40, 24, generator=gen)
    bounds = slice_bounds(rows, slices)
    set_tp(0, 2)
    try:
        out = projection_all_reduce_overlapped(x, Logged(default_kernels(w)), slices, "mlp.down")
    finally:
        set_tp(0, 1)
    expected = [event for i in range(slices) for event in (("gemm", i), ("reduce", i))] + [("wait", i) for i in range(slices)]
    assert log == expected
    # Every all-reduce worked in place on its rows of the returned buffer.
    assert [t.data_ptr() for t in issued] == [out[lo:hi].data_ptr() for lo, hi in bounds]
    torch.testing.assert_close(out, 2 * (x @ w.t()))

"""The all-reduce cost model: the least-squares fit recovers the fixed term and the bandwidth from
synthetic timings, sizes parse as nccl-tests reads them, and `pocketllm allreduce` prints the
nccl-tests columns and the fit line on a real TP=2 gloo group, where only rank 0 checks the
inputs and every rank runs on its result."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import cli_env, run_cli, usage_error_in_process
from pocketllm.distributed.allreduce_bench import bus_factor, fit_latency_bandwidth
from pocketllm.flags import parse_size, size_ladder
from pocketllm.errors import UsageError

SIZES = [2**k for k in range(10, 27)]  # 1K .. 64M


def _times_us(fixed_us: float, gbps: float, noise=None) -> list[float]:
    out = []
    for i, b in enumerate(SIZES):
        t = fixed_us + b / (gbps * 1e3)
        out.append(t * (1 + noise[i % len(noise)]) if noise else t)
    return out


@pytest.mark.parametrize("fixed_us, gbps", [(1700.0, 22.7), (12.0, 150.0), (60.0, 1.5)])
def test_fit_recovers_exact_terms(fixed_us, gbps):
    """The seed's 910A terms, a GPU-like 100x smaller fixed term, and a gloo-on-CPU-like one."""
    fit = fit_latency_bandwidth(SIZES, _times_us(fixed_us, gbps))
    assert fit.fixed_us == pytest.approx(fixed_us, rel=1e-6)
    assert fit.bandwidth_GBps == pytest.approx(gbps, rel=1e-6)
    assert fit.max_rel_err < 1e-9


def test_fit_with_noise_keeps_the_fixed_term():
    """+-3% multiplicative noise: a plain least-squares fit would let the 64M point's error swamp a
    60 us fixed term; the relative fit keeps it within the noise."""
    noise = [0.03, -0.02, 0.01, -0.03, 0.02, 0.0, -0.01]
    fit = fit_latency_bandwidth(SIZES, _times_us(60.0, 1.5, noise))
    assert fit.fixed_us == pytest.approx(60.0, rel=0.05)
    assert fit.bandwidth_GBps == pytest.approx(1.5, rel=0.05)
    assert 0.02 < fit.max_rel_err < 0.07


def test_fit_without_a_byte_term_reports_infinite_bandwidth():
    fit = fit_latency_bandwidth([1024, 2048, 4096], [50.0, 50.0, 50.0])
    assert fit.fixed_us == pytest.approx(50.0)
    assert math.isinf(fit.bandwidth_GBps) or fit.bandwidth_GBps > 1e6
    # Times that fall as the bytes grow (noise over small sizes): the fixed term is their
    # relative-error mean, inside the points, not the intercept of the falling line above them all.
    fit = fit_latency_bandwidth([1024, 2048, 4096], [24.88, 25.06, 16.46])
    assert math.isinf(fit.bandwidth_GBps) and 16.46 < fit.fixed_us < 25.06
    assert fit.max_rel_err < 0.4 and fit.to_json()["bandwidth_GBps"] is None
    assert json.loads(json.dumps(fit.to_json(), allow_nan=False))["fixed_us"] == fit.fixed_us
    # Printed as inf in its key=value line, with a note under it saying what that means.
    assert "bandwidth_GBps=inf" in fit.line() and "not measurable" in fit.note()
    assert fit_latency_bandwidth([1024, 4096], [10.0, 20.0]).note() is None


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError):
        fit_latency_bandwidth([1024], [10.0])
    with pytest.raises(ValueError):
        fit_latency_bandwidth([1024, 1024], [10.0, 11.0])


def test_sizes_and_bus_factor():
    assert parse_size("1K", "--min-bytes") == 1024
    assert parse_size("64m", "--max-bytes") == 64 * 2**20
    assert parse_size("4096", "--min-bytes") == 4096
    for bad in ("abc", "0", "-1K", "1.5M", ""):
        with pytest.raises(UsageError):
            parse_size(bad, "--min-bytes")
    assert size_ladder(1024, 8192, 2, 2) == [1024, 2048, 4096, 8192]
    assert size_ladder(1000, 1000, 2, 4) == [1000]
    with pytest.raises(UsageError):
        size_ladder(1024, 8192, 1, 2)
    with pytest.raises(UsageError):
        size_ladder(8192, 1024, 2, 2)
    assert bus_factor(2) == 1.0 and bus_factor(4) == 1.5


def test_allreduce_command_at_tp2(tmp_path):
    out = tmp_path / "ar.json"
    r = run_cli("allreduce", "--tp-world", "2", "--min-bytes", "1K", "--max-bytes", "64K", "--iters", "3", "--json", out, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["size_bytes", "count", "dtype", "time_us", "device_us", "algbw_GBps", "busbw_GBps"]
    # The fit's line, and under it the note a noisy run's unmeasurable byte term adds (payloads of
    # 1-64 KiB over gloo are latency alone; once in a few runs the larger took no longer).
    assert len(lines) == 1 + 7 + 1 or (len(lines) == 1 + 7 + 2 and lines[-1].startswith("note: bandwidth_GBps=inf")), lines
    fit_fields = dict(p.split("=") for p in lines[8].split())
    assert set(fit_fields) == {"fixed_us", "bandwidth_GBps", "max_rel_err"}
    data = json.loads(out.read_text())
    assert data["backend"] == "gloo" and data["world"] == 2 and len(data["sizes"]) == 7
    for row in data["sizes"]:
        # On CPU there are no device events: device_us is the wall time.
        assert row["device_us"] == row["time_us"] > 0
        assert row["count"] * 2 == row["size_bytes"]
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-bytes", "lots"], "--min-bytes 'lots' is not a size"),
        (["--factor", "1"], "--factor must be an integer >= 2"),
        (["--tp-world", "1"], "--tp-world must be >= 2"),
        (["--dtype", "int8"], "--dtype 'int8'"),
        (["--min-bytes", "1K", "--max-bytes", "1K"], "--min-bytes 1K to --max-bytes 1K is one payload size"),
        (["--min-bytes", "1K", "--max-bytes", "3K", "--factor", "4"], "two or more: give a --max-bytes of at least --factor (4)"),
    ],
)
def test_allreduce_errors(args, message, capsys, no_ranks):
    usage_error_in_process(capsys, "allreduce", *args, expect=message)


def test_under_torchrun_the_default_world_is_world_size(capsys, no_ranks, monkeypatch):
    # With --tp-world left out the world is torchrun's WORLD_SIZE (here 1: refused as too few, so
    # this process never joins a group), not the local default of 2 disagreeing with it.
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    usage_error_in_process(capsys, "allreduce", expect="--tp-world must be >= 2 to time an all-reduce, got 1")


# One hand-started rank of run_without_model: prepare leaves a file naming the rank that ran it and
# returns that process's id; work writes down the id it was given.
_RANK_SCRIPT = """
import os, sys
from pocketllm.commands.ranked import run_without_model
from pocketllm.run_plan import DevicePlan, RunPlan, WorldPlan

rank, id_path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
run = RunPlan("allreduce", DevicePlan("cpu", "cpu"), WorldPlan(2, rank, id_path, dist_timeout=60.0))

def prepare(run):
    open(os.path.join(out, f"prepared.{rank}"), "w").close()
    return os.getpid()

def work(run, device, inputs):
    with open(os.path.join(out, f"inputs.{rank}"), "w") as f:
        f.write(str(inputs))
    return 0

code = run_without_model(run, prepare, work)
# Without the interpreter's teardown of torch (conftest.end_process says why).
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def test_on_the_ranks_only_rank_0_prepares(tmp_path):
    cmd = [sys.executable, "-c", _RANK_SCRIPT]
    procs = [subprocess.Popen([*cmd, str(r), str(tmp_path / "run.id"), str(tmp_path)], stderr=subprocess.PIPE, text=True, env=cli_env()) for r in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    # Each rank preparing for itself would leave prepared.1 and hand rank 1 its own id.
    assert sorted(f.name for f in tmp_path.glob("prepared.*")) == ["prepared.0"]
    assert (tmp_path / "inputs.0").read_text() == (tmp_path / "inputs.1").read_text() == str(procs[0].pid)


def test_a_line_below_zero_at_zero_bytes_is_fitted_through_zero():
    # 10 us per KB less 5 us: the line's intercept is negative; no latency is less than none, so
    # the fit holds it at zero and keeps the byte term (their relative-error best through zero).
    fit = fit_latency_bandwidth([1000, 2000, 4000], [5.0, 15.0, 35.0])
    assert fit.fixed_us == 0.0 and fit.bandwidth_GBps == pytest.approx(1000 / 8.0 / 1e3, rel=0.5)
    assert all(fit.predict_us(x) > 0 for x in (1000, 2000, 4000))

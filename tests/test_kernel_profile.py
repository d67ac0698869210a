"""`pocketllm bench --kernel-profile`: the prefill and the decode steps once more under torch.profiler,
each as a table of where its time went, in rank 0's notes and the JSON."""

from __future__ import annotations

import json

import pytest
from conftest import main_in_process

from pocketllm.profiling import kernel_profile


def test_the_table_groups_by_name_keeps_the_largest_and_sums_the_rest():
    events = [("gemm", 30.0), ("norm", 5.0), ("gemm", 50.0), ("rope", 1.0), ("norm", 4.0), ("conv", 2.0)]
    t = kernel_profile.table("prefill", 0.2, events, top=2)
    assert t.rows == [("gemm", 2, pytest.approx(0.08)), ("norm", 2, pytest.approx(0.009)), ("(2 others)", 2, pytest.approx(0.003))]
    assert t.calls == 6 and t.busy_ms == pytest.approx(0.092) and t.wall_ms == pytest.approx(200.0)
    lines = kernel_profile.describe(t, "cuda")
    assert lines[0] == "kernel profile, prefill: wall 200.00 ms, device busy 0.09 ms (0%), 6 kernels"
    assert lines[2].split() == ["0.080", "87.0%", "2", "gemm"]


# A warning of torch's profiler (torch 2.11 warned at each start) is a line a user did not ask for.
@pytest.mark.filterwarnings("error:::torch\\.profiler")
@pytest.mark.timeout(120)
def test_bench_prints_and_writes_its_ready_time_and_a_table_for_the_prefill_and_one_for_the_decode_steps(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ("bench", "--preset", "tiny", "--prompt-tokens", 48, "--max-new-tokens", 4, "--warmup-tokens", 4, "--batch", 2)
    assert main_in_process(*args, "--kernel-profile", "--json", out) == 0
    err = capsys.readouterr().err
    whole = json.loads(out.read_text())
    doc = whole["kernel_profile"]
    # The ready line and figure (this process's age, the test's process here) come before the run.
    assert f"ready {whole['ready_seconds']:.1f} s after the process started (loaded and warmed up)" in err
    assert "kernel profile, prefill of 2 x 48 tokens: wall " in err
    assert "kernel profile, 4 decode steps, decode step: " in err
    for phase in ("prefill", "decode"):
        t = doc[phase]
        # Time inside torch's ops, on the calling thread, fits in the wall around them.
        assert 0 < t["busy_ms"] <= t["wall_ms"]
        assert sum(calls for _, calls, _ in t["top"]) == t["calls"]
        assert sum(ms for _, _, ms in t["top"]) == pytest.approx(t["busy_ms"])
        named = [ms for name, _, ms in t["top"] if not name.endswith(" others)")]
        assert named == sorted(named, reverse=True)
    # The prefill reads 96 rows through the layers: far more ops than the decode steps issue.
    assert doc["prefill"]["calls"] > doc["decode"]["calls"]

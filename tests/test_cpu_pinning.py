"""The launcher pins each rank it starts to its own share of the cores it may run on, and a rank
gives torch as many threads as it has cores; a single-rank run stays unpinned."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import cli_env, run_cli, usage_error_in_process
from pocketllm.device import allowed_cpus, cpu_shares


@pytest.mark.parametrize(
    "world,cpus,expected",
    [
        (2, [0, 1, 2, 3], [[0, 1], [2, 3]]),
        (2, [0, 1, 2], [[0], [1]]),
        (4, [0, 1], [[0], [1], [0], [1]]),
        (3, [4, 6, 8], [[4], [6], [8]]),
        (1, [0, 1], [[0, 1]]),
    ],
    ids=["4cores-tp2", "3cores-tp2-one-idle", "2cores-tp4-shared", "gapped-ids", "tp1"],
)
def test_cpu_shares(world, cpus, expected):
    assert cpu_shares(world, cpus) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"tp{w}")
def test_bench_ranks_run_on_their_share_of_the_cores(world, tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "--preset", "tiny", "--tp-world", world, "--prompt-tokens", 16, "--max-new-tokens", 2, "--json", out)
    assert r.returncode == 0, r.stderr
    settings = json.loads(out.read_text())["settings"]
    mine = allowed_cpus()
    if world == 1:
        # One rank is this command's own process: it keeps every core it was given.
        assert settings["cpus_per_rank"] == [mine]
        assert settings["threads_per_rank"] == len(mine)
    else:
        shares = cpu_shares(world, mine)
        assert settings["cpus_per_rank"] == shares
        assert settings["threads_per_rank"] == len(shares[0])
    assert len(settings["peak_rss_mib_per_rank"]) == world and min(settings["peak_rss_mib_per_rank"]) > 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
@pytest.mark.timeout(120)
def test_launcher_splits_the_cores_it_was_given(tmp_path):
    # Started on one core only, both ranks share it: the launcher divides its own affinity, which
    # is how two launches are kept apart on one machine.
    first = allowed_cpus()[:1]
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pocketllm", "bench", "--preset", "tiny", "--tp-world", "2", "--prompt-tokens", "16",
           "--max-new-tokens", "2", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=cli_env(), preexec_fn=lambda: os.sched_setaffinity(0, first))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["settings"]["cpus_per_rank"] == [first, first]


@pytest.mark.timeout(120)
def test_pinning_can_be_turned_off(tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "--preset", "tiny", "--tp-world", 2, "--prompt-tokens", 16, "--max-new-tokens", 2, "--json", out,
                env=cli_env(POCKETLLM_PIN_CPUS="0"))
    assert r.returncode == 0, r.stderr
    settings = json.loads(out.read_text())["settings"]
    mine = allowed_cpus()
    assert settings["cpus_per_rank"] == [mine, mine]
    assert settings["threads_per_rank"] == max(1, len(mine) // 2)


def test_bad_pin_switch_is_a_usage_error(capsys, no_ranks, monkeypatch):
    monkeypatch.setenv("POCKETLLM_PIN_CPUS", "maybe")
    line = usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--tp-world", "2")
    assert "POCKETLLM_PIN_CPUS='maybe' is not a switch" in line, line

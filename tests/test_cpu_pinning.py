"""The launcher pins each rank it starts to its own share of the cores it may run on, and a rank
gives torch as many threads as it has cores; a single-rank run stays unpinned. The TP=2 bench runs
here also check the all-reduce chosen, how ranks wait for it, and the collectives a pass issues."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import cli_env, main_in_process, result_fields, run_cli, shm_segments, usage_error_in_process
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


@pytest.mark.parametrize("pinned,threads", [(True, 4), (False, 2)], ids=["pinned", "unpinned"])
def test_a_pinned_rank_takes_a_thread_per_core_it_owns(pinned, threads, monkeypatch):
    # A rank of two whose affinity holds four cores: pinned by the launcher, those four are its
    # own and it runs four threads; unpinned, it shares them with its peer and takes half.
    from pocketllm import device

    monkeypatch.setattr(device, "allowed_cpus", lambda: [0, 1, 2, 3])
    if pinned:
        monkeypatch.setenv(device.ENV_RANK_CPUS, "0,1,2,3")
    else:
        monkeypatch.delenv(device.ENV_RANK_CPUS, raising=False)
    saved = torch.get_num_threads()
    try:
        device.setup_device("cpu", local_rank=0, world=2)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(saved)


# Each TP=2 run also carries the checks of other modules that only need a TP=2 bench: the
# all-reduce it chose (shm or gloo), how its ranks wait (polling or blocking), the collectives a
# pass issues at a pinned slice count, and /dev/shm left as it was found.
BENCH_RUNS = {
    # One rank is this command's own process, run here.
    "tp1": (1, {}, []),
    "tp2-pinned-shm-3-slices": (2, {}, ["--collective", "shm", "--layers", 64, "--pin-slices", 3]),
    "tp2-unpinned-gloo-blocking-serial": (
        2, {"POCKETLLM_PIN_CPUS": "0", "POCKETLLM_POLL_COLLECTIVES": "0", "POCKETLLM_COLLECTIVE": "gloo"}, ["--layers", 64, "--pin-slices", 1],
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", list(BENCH_RUNS))
def test_bench_ranks_run_on_their_share_of_the_cores(run, tmp_path, capsys):
    world, env, extra = BENCH_RUNS[run]
    out = tmp_path / "r.json"
    args = ["bench", "--preset", "tiny", "--tp-world", world, "--prompt-tokens", 16, "--max-new-tokens", 2, "--warmup-tokens", 4, "--json", out, *extra]
    segments = shm_segments()
    if world == 1:
        rc = main_in_process(*args)
        stdout, stderr = capsys.readouterr()
    else:
        r = run_cli(*args, env=cli_env(**env))
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    assert rc == 0, stderr
    settings = json.loads(out.read_text())["settings"]
    mine = allowed_cpus()
    if world == 1:
        assert settings["cpus_per_rank"] == [mine]
        assert settings["threads_per_rank"] == len(mine)
    elif env.get("POCKETLLM_PIN_CPUS") == "0":
        # Unpinned ranks may run anywhere and split the cores' count between them.
        assert settings["cpus_per_rank"] == [mine] * world
        assert settings["threads_per_rank"] == max(1, len(mine) // world)
    else:
        shares = cpu_shares(world, mine)
        assert settings["cpus_per_rank"] == shares
        assert settings["threads_per_rank"] == len(shares[0])
    assert len(settings["peak_rss_mib_per_rank"]) == world and min(settings["peak_rss_mib_per_rank"]) > 0
    # gloo ranks poll for their collectives unless told not to; one rank has none to wait for.
    assert settings["polls_collectives"] is (world > 1 and env.get("POCKETLLM_POLL_COLLECTIVES") != "0")
    notes = [line for line in stderr.splitlines() if line.startswith("all-reduce:")]
    if world == 1:
        assert settings["collective"] is None and notes == []
    elif "--collective" in extra:
        assert settings["collective"] == "shm"
        assert notes == ["all-reduce: shm (shared memory, 2 CPU ranks on this host; gloo for the other collectives)"]
    else:
        assert settings["collective"] == "gloo"
    if world > 1:
        # A pass issues one all-reduce per slice at each of the 64 layers' mlp.down, the 48
        # linear-attention and 16 full-attention output projections, plus the embedding's.
        fields = result_fields(stdout)
        slices = int(extra[extra.index("--pin-slices") + 1])
        assert int(fields["slices"]) == slices
        assert int(fields["collectives"]) == 64 * slices + 48 * slices + 16 * slices + 1
    assert shm_segments() == segments


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
@pytest.mark.timeout(120)
def test_launcher_splits_the_cores_it_was_given(tmp_path):
    # Started on one core only, both ranks share it: the launcher divides its own affinity, which
    # is how two launches are kept apart on one machine.
    first = allowed_cpus()[:1]
    out = tmp_path / "r.json"
    r = run_cli("bench", "--preset", "tiny", "--tp-world", 2, "--prompt-tokens", 16, "--max-new-tokens", 2, "--json", out,
                preexec_fn=lambda: os.sched_setaffinity(0, first))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["settings"]["cpus_per_rank"] == [first, first]


@pytest.mark.parametrize("switch", ["POCKETLLM_PIN_CPUS", "POCKETLLM_POLL_COLLECTIVES"])
def test_a_bad_launcher_switch_is_a_usage_error(switch, capsys, no_ranks, monkeypatch):
    monkeypatch.setenv(switch, "maybe")
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--tp-world", "2", expect=f"{switch}='maybe' is not a switch")

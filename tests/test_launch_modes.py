"""The same command gives the same tokens however its ranks were started: by pocketllm's own
launcher, by torchrun, or one process per rank by hand with a rendezvous file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import cli_env, run_cli

ARGS = ["generate", "--preset", "tiny", "--dtype", "float32", "--token-ids", "5,6,7,8,9,10,11,12", "--max-new-tokens", "6"]


def ids_line(stdout: str) -> str:
    return next(l for l in stdout.splitlines() if l.startswith("generated_ids="))


def launcher_ids() -> str:
    r = run_cli(*ARGS, "--tp-world", "2")
    assert r.returncode == 0, r.stderr
    return ids_line(r.stdout)


def test_torchrun_matches_launcher():
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pocketllm", *ARGS, "--tp-world", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env())
    assert r.returncode == 0, r.stderr
    # Only rank 0 prints results.
    assert sum(l.startswith("generated_ids=") for l in r.stdout.splitlines()) == 1
    assert ids_line(r.stdout) == launcher_ids()


def test_hand_started_ranks_match_launcher(tmp_path):
    rdzv = tmp_path / "run.id"
    cmd = [sys.executable, "-m", "pocketllm", *ARGS, "--tp-world", "2", "--nccl-id-path", str(rdzv)]
    procs = [
        subprocess.Popen([*cmd, "--tp-rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1] + outs[1][1]
    assert outs[1][0].strip() == ""
    assert ids_line(outs[0][0]) == launcher_ids()

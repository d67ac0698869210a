"""Shared test helpers: run the CLI as a user would (a fresh process, short timeouts), and build
tiny HF checkpoints with transformers as the oracle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("QWEN_COMM_OVERLAP_SLICES", None)
    env.pop("QWEN_COMM_OVERLAP_PIN", None)
    env.pop("QWEN_GDN_KERNEL", None)
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(*args, timeout: float = 120, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """`python -m pocketllm ARGS`; a hang fails the test at `timeout` seconds."""
    cmd = [sys.executable, "-m", "pocketllm", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or cli_env(), cwd=cwd)


def result_fields(stdout: str) -> dict[str, str]:
    """key=value pairs of the last line that has them."""
    for line in reversed(stdout.strip().splitlines()):
        if "=" in line:
            return dict(part.split("=", 1) for part in line.split())
    return {}


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny preset written as an HF checkpoint by `pocketllm make-checkpoint`."""
    out = tmp_path_factory.mktemp("tiny_ckpt")
    r = run_cli("make-checkpoint", "--preset", "tiny", "--out", out)
    assert r.returncode == 0, r.stderr
    return out

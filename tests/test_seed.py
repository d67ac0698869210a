"""The seed's interface (docs/seed.md): its section 8 rank command, read from docs/seed.md, runs as
written through the `pocketllm_engine` console script's entry point and `pocketllm engine`, rank 0
printing the seed's result line; the seed's QWEN_PHASE_PROFILE=1 and QWEN_HOST_PROFILE=1 print
their profiles; and the seed's `--device 0` is a device index, which on a CPU may only be 0."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib

import pytest
import torch

from conftest import REPO, UNSET_FOR_CLI, cli_env, main_in_process, result_fields, usage_error_in_process
from pocketllm.device_kind import npu_available
from pocketllm.inputs import BENCH_PATTERN

RESULT = ("prefill_seconds", "prefill_tokens_per_s", "decode_seconds", "decode_tokens_per_s")


def section_8_command() -> tuple[dict[str, str], list[str]]:
    """The variables and the words of the command docs/seed.md gives for the seed's section 8."""
    text = (REPO / "docs" / "seed.md").read_text()
    block = re.search(r"<!-- seed-section-8[^>]*-->\s*```bash\n(.*?)```", text, re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    env = {}
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def with_values(words: list[str], values: dict[str, str]) -> list[str]:
    """The command's words with the value after each flag in `values` replaced (this run's paths)."""
    out = list(words)
    for flag, value in values.items():
        out[out.index(flag) + 1] = str(value)
    return out


def console_script(name: str) -> list[str]:
    """What running the console script pyproject.toml declares does, as a command line."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][name]
    module, func = target.split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


@pytest.mark.timeout(120)
def test_the_seeds_section_8_command_runs_at_tp2_with_hand_started_ranks(tiny_ckpt, tmp_path):
    env, words = section_8_command()
    assert words[0] == "pocketllm_engine"
    assert env == {"QWEN_COMM_OVERLAP_SLICES": "4", "POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS": "12000"}
    ids = [t % 1000 for t in BENCH_PATTERN] * 3  # the seed's ids, inside the tiny vocab
    (tmp_path / "ids.txt").write_text(",".join(map(str, ids)) + "\n")
    values = {"--ckpt": tiny_ckpt, "--token-ids-file": "ids.txt", "--max-new-tokens": 3, "--tp-world": 2, "--nccl-id-path": "run.id"}
    # As the seed's section 5 runs did, with the phase profile on: every rank prints its blocks.
    run_env = cli_env(**env, QWEN_PHASE_PROFILE="1")
    procs = {}
    for rank in (1, 0):
        argv = with_values(words[1:], {**values, "--tp-rank": rank})
        # Rank 0 through the console script's entry point, rank 1 as `pocketllm engine`.
        cmd = [*console_script("pocketllm_engine"), *argv] if rank == 0 else [sys.executable, "-m", "pocketllm", "engine", *argv]
        procs[rank] = subprocess.Popen(cmd, env=run_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {rank: p.communicate(timeout=100) for rank, p in procs.items()}
    for rank, p in procs.items():
        assert p.returncode == 0, outs[rank][1]
        stderr = outs[rank][1]
        assert "Traceback" not in stderr and "warning" not in stderr, stderr
        # --smoke-layers 0 runs every layer; --device 0 is the CPU.
        assert "4 layers, TP=2, bfloat16 on CPU" in stderr or rank != 0, stderr
        headers = [line for line in stderr.splitlines() if line.startswith("qwen_phase ")]
        assert headers and all(f" rank={rank} " in h for h in headers), stderr
        assert any(" kind=prefill rows=30 timed=1 " in h for h in headers), headers
    fields = result_fields(outs[0][0])
    assert set(RESULT) <= set(fields), outs[0][0]
    assert (fields["prefill_tokens"], fields["decode_tokens"]) == ("30", "3")
    assert all(float(fields[k]) > 0 for k in RESULT)
    assert "prefill_seconds" not in outs[1][0]
    # Rank 0 made the rendezvous file and removed it with its store.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.txt"]


@pytest.mark.parametrize(
    "variable, block, layers",
    [("QWEN_PHASE_PROFILE", "phase", "0"), ("QWEN_HOST_PROFILE", "host", "2")],
    ids=["phase", "host"],
)
def test_the_seeds_profile_variables_print_their_profiles(variable, block, layers, tmp_path, capsys, monkeypatch):
    # Before the seed's names were read, this run stopped at --profile-out ("needs a profile"),
    # and without --profile-out printed no profile at all.
    for name in UNSET_FOR_CLI:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    out_dir = tmp_path / "profile"
    rc = main_in_process(
        "engine", "--preset", "tiny", "--smoke-forward", "--smoke-layers", layers, "--resident-bench", "--prompt-tokens", 8,
        "--max-new-tokens", 1, "--warmup-tokens", 4, "--device", 0, "--profile-out", out_dir,
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert set(RESULT) <= set(result_fields(out))
    assert f"loaded preset:tiny: {layers if layers != '0' else 4} layers" in err
    headers = [line for line in err.splitlines() if line.startswith(("qwen_phase ", "qwen_host "))]
    assert headers and all(h.startswith(f"qwen_{block} ") for h in headers), err
    assert any(" kind=prefill rows=8 timed=1 " in h for h in headers), headers
    assert sorted(p.name for p in out_dir.iterdir()) == [f"{block}-rank0.jsonl"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (("bench", "--preset", "tiny", "--device", "1"), "--device 1: no CUDA or NPU device is visible, and the CPU is device 0"),
        (("generate", "--preset", "tiny", "--token-ids", "1,2", "--device", "3", "--tp-world", "2"), "--device 3: no CUDA or NPU device"),
        (("bench", "--preset", "tiny", "--device", "gpu"), "--device 'gpu' is not one of auto, cpu, cuda, npu, cuda:N, npu:N or a device index N"),
        (("engine", "--preset", "tiny", "--smoke-layers", "-1"), "--smoke-layers must be >= 0 (0 runs every layer), got -1"),
        (("engine", "--preset", "tiny", "--smoke-layers", "0", "--layers", "2"), "--smoke-layers 0 and --layers 2 disagree"),
        (("bench", "--preset", "tiny", "--tp-world", "1", "--cpus", "0"), "--cpus pins the ranks that --tp-world N starts here"),
    ],
    ids=["device-1-on-cpu", "device-3-on-cpu-tp2", "device-kind", "smoke-layers-negative", "smoke-layers-and-layers", "cpus-without-launcher"],
)
def test_seed_flag_errors_are_one_line_exit_2(argv, needle, capsys, no_ranks):
    if "no CUDA or NPU" in needle and (torch.cuda.is_available() or npu_available()):
        pytest.skip("a device index names a real device on this machine")
    usage_error_in_process(capsys, *argv, expect=needle)


def test_smoke_layers_past_a_checkpoints_stack_names_that_flag(tiny_ckpt, capsys, no_ranks):
    usage_error_in_process(capsys, "engine", "--ckpt", tiny_ckpt, "--smoke-layers", "9", expect="--smoke-layers 9: the checkpoint has only 4 layers")

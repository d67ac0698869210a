"""The scripts in benchmarks/ refuse bad input as the CLI does: one line `NAME: error: MESSAGE` on
stderr and exit code 2, before any model loads or peer runs, no traceback. Each case calls a
script's main(argv) in this process and stops at the check, so none loads a model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import batch_ab  # noqa: E402
import chat_turns  # noqa: E402
import chunk_size  # noqa: E402
import common  # noqa: E402
import core_bandwidth  # noqa: E402
import device_check  # noqa: E402
import gemm_cache_memory  # noqa: E402
import gemm_row_dependence  # noqa: E402
import long_context  # noqa: E402
import quant_accuracy  # noqa: E402
import quant_kernels  # noqa: E402
import serve_load  # noqa: E402
import serve_memory  # noqa: E402
import shared_prompt  # noqa: E402
import switch_ab  # noqa: E402
import tp_ab  # noqa: E402
import vs_llama_cpp  # noqa: E402
import vs_llama_cpp_quant  # noqa: E402
import vs_transformers  # noqa: E402
import vs_vllm  # noqa: E402


def refused(capsys, main, argv: list[str]) -> str:
    """main(argv)'s one-line refusal, after checking it exits 2 with nothing else on stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]


@pytest.fixture
def gguf(tmp_path) -> str:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"")
    return str(path)


CASES = [
    (tp_ab, ["--collectives", "shm,tcp"], "--collectives"),
    (vs_transformers, ["--lengths", "a"], "--lengths"),
    (vs_transformers, ["--lengths", "0"], "--lengths"),
    (vs_transformers, ["--decode-tokens", "0"], "--decode-tokens"),
    (vs_transformers, ["--threads", "0"], "--threads"),
    (vs_transformers, ["--reps", "3"], "--reps"),
    (vs_transformers, ["--dtype", "int8"], "--dtype"),
    (vs_transformers, ["--ckpt", "x", "--random-weights"], "--random-weights"),
    (vs_transformers, ["--engine", "pocketllm"], "--engine"),
    (vs_transformers, ["--preset", "tiny", "--json", "/nope/x.json"], "/nope"),
    (chunk_size, ["--lengths", "x"], "--lengths"),
    (chunk_size, ["--sizes", "0,32"], "--sizes"),
    (chunk_size, ["--value-heads", "3", "--key-heads", "2"], "--value-heads"),
    (gemm_row_dependence, ["--shapes", "256by128"], "--shapes"),
    (gemm_row_dependence, ["--rows", "0"], "--rows"),
    (gemm_row_dependence, ["--dtype", "int8"], "--dtype"),
    (core_bandwidth, ["--kernel", "nope"], "--kernel"),
    (core_bandwidth, ["--mib", "0"], "--mib"),
    (batch_ab, ["--env", "NOEQUALS"], "--env"),
    (batch_ab, ["--baseline", "/nope"], "/nope"),
    (switch_ab, ["--switch", "NOT_A_SWITCH"], "NOT_A_SWITCH"),
    (switch_ab, ["--reps", "3"], "--reps"),
    (quant_kernels, ["--schemes", "int8,int3"], "int3"),
    (quant_accuracy, ["--ckpt", "x", "--llama-perplexity", "/nope/lp", "--gguf-dir", "/nope"], "/nope/lp"),
    # With less than a step needs to start, every step is skipped and the table reads as passed.
    (device_check, ["--timeout", "0"], "--timeout"),
    (device_check, ["--budget", "-5"], "--budget"),
    (device_check, ["--budget", "nan"], "--budget"),
    (quant_kernels, ["--candidates", "c,nope"], "nope"),
    (quant_kernels, ["--no-timing"], "--no-timing goes with --errors"),
    # The results of a whole run would be lost at its end, or nothing would run.
    (serve_load, ["--json", "/nope/x.json"], "/nope"),
    (serve_load, ["--clients", "1,0"], "--clients"),
    (serve_load, ["--requests-per-client", "0"], "--requests-per-client"),
    (serve_memory, ["--clients", "0"], "--clients"),
    (serve_memory, ["--max-len", "600"], "--max-len"),
    (vs_vllm, ["--ckpt", "x", "--results", "/nope/r.json"], "/nope"),
    (vs_vllm, ["--ckpt", "x", "--num-prompts", "0"], "--num-prompts"),
    (gemm_cache_memory, ["--prompts", "1"], "--prompts"),
    (gemm_cache_memory, ["--lengths", "5-2"], "--lengths"),
    (gemm_cache_memory, ["--preset", "tiny", "--lengths", "1-40000"], "positions"),
    (chat_turns, ["--answer", "0"], "--answer"),
    (chat_turns, ["--reps", "3"], "--reps"),
    (chat_turns, ["--preset", "tiny", "--system", "40000"], "over the model's 32768"),
    (shared_prompt, ["--n", "0"], "--n"),
    (shared_prompt, ["--reps", "3"], "--reps"),
    (shared_prompt, ["--preset", "tiny", "--prompt-tokens", "40000"], "over the model's 32768"),
]


@pytest.mark.parametrize(("script", "argv", "names"), CASES, ids=[f"{s.__name__} {' '.join(a)}" for s, a, _ in CASES])
def test_bad_flag_is_one_line(capsys, script, argv, names):
    line = refused(capsys, script.main, argv)
    assert line.startswith(f"{script.__name__}.py: error: ") and names in line


@pytest.mark.parametrize("script", [vs_llama_cpp, long_context])
def test_missing_llama_bench_is_refused_before_the_model_loads(capsys, gguf, script):
    line = refused(capsys, script.main, ["--ckpt", "x", "--gguf", gguf, "--llama-bench", "/nope/llama-bench"])
    assert "/nope/llama-bench is not an executable" in line


def test_device_check_without_the_device_says_so_and_exits_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_check.main(["--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == ["device_check: no cuda device is visible to torch; nothing to check"]
    assert captured.out.startswith("python ") and f"torch {torch.__version__}" in captured.out


def test_a_device_check_step_past_its_limit_gets_ctrl_c_first_and_its_output_is_kept(monkeypatch, tmp_path):
    """A step past its limit is interrupted as by Ctrl-C (pytest then reports the tests that
    finished, a test's server is stopped by its fixture) before any kill, and what it printed is
    kept, in --out's log too."""
    monkeypatch.setattr(device_check, "LOG", tmp_path / "device_check.log")
    code = "import time\ntry:\n    print('started', flush=True)\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('reported what finished')\n"
    rc, out, _, seconds = device_check._run([sys.executable, "-c", code], device_check.GRACE_S + 1)
    assert rc is None and out == "started\nreported what finished\n" and seconds < device_check.GRACE_S
    log = device_check.LOG.read_text()
    assert "reported what finished" in log and "past its limit" in log


def test_a_device_test_file_that_cannot_be_imported_is_a_row_naming_why_and_the_rest_still_run(monkeypatch, tmp_path):
    """tests/device on a machine that lacks a package one file imports: that file is a FAIL row
    with the import's error, and the other files' tests still run, each a row."""
    (tmp_path / "test_lacks.py").write_text("import no_such_package_here\n\n\ndef test_never():\n    pass\n")
    (tmp_path / "test_runs.py").write_text("def test_runs():\n    pass\n")
    monkeypatch.setattr(device_check, "device_test_files", lambda group: [str(tmp_path / "test_lacks.py"), str(tmp_path / "test_runs.py")])
    table = device_check.Table()
    device_check.device_tests(table, 60)
    rows = {step: (outcome, detail) for step, outcome, detail, _ in table.rows}
    assert rows["test_runs::test_runs"] == ("pass", "")
    failed = [(step, detail) for step, (outcome, detail) in rows.items() if outcome == "FAIL"]
    assert len(failed) == 1 and "No module named 'no_such_package_here'" in failed[0][1], rows


def test_depths_past_the_models_positions_are_refused_before_it_loads(capsys, tiny_ckpt):
    line = refused(capsys, long_context.main, ["--ckpt", str(tiny_ckpt), "--depths", "64,40000", "--decode-tokens", "2", "--reps", "2"])
    assert "--depths up to 40000" in line and "over the model's 32768" in line


def test_llama_perplexity_too_few_positions_or_its_crash_is_one_line(capsys, tmp_path):
    from pocketllm.errors import UsageError

    # 2 chunks of 64 score 62 positions: llama-perplexity would print no KL statistics at all.
    line = refused(capsys, quant_accuracy.main, ["--ckpt", "x", "--ctx", "64", "--chunks", "2", "--llama-perplexity", "/bin/true", "--gguf-dir", str(tmp_path)])
    assert "scores 62 positions" in line and "under 100" in line
    crashing = tmp_path / "llama-perplexity"
    crashing.write_text("#!/bin/sh\necho 'loading model' >&2\necho 'GGML_ASSERT(sect_dims <= ne0) failed' >&2\nkill -ABRT $$\n")
    crashing.chmod(0o755)
    with pytest.raises(UsageError) as exc:
        quant_accuracy.run_llama([str(crashing), "-f", "text", "-m", "tiny-f32.gguf"])
    assert str(exc.value) == "llama-perplexity failed (signal 6) on tiny-f32.gguf: GGML_ASSERT(sect_dims <= ne0) failed"


def test_a_bench_flag_passed_on_and_refused_is_the_scripts_usage_error(capsys, tiny_ckpt):
    """Flags a script passes on to `pocketllm bench` as given: bench's refusal ends the script with
    bench's line and bench's exit code 2, not 1."""
    line = refused(capsys, batch_ab.main, ["--ckpt", str(tiny_ckpt), "--bogus", "1"])
    assert line == "pocketllm bench failed: pocketllm: error: unrecognized arguments: --bogus 1"


def test_missing_gguf_is_refused(capsys):
    line = refused(capsys, vs_llama_cpp.main, ["--ckpt", "x", "--gguf", "/nope.gguf", "--llama-bench", "/bin/true"])
    assert "no file /nope.gguf" in line


def test_pair_scheme_and_binary_are_checked_first(capsys, gguf):
    assert "not an executable" in refused(capsys, vs_llama_cpp_quant.main, ["--ckpt", "x", "--llama-bench", "/nope/lb", "--pair", f"int8={gguf}"])
    assert "'int3' is not a scheme" in refused(capsys, vs_llama_cpp_quant.main, ["--ckpt", "x", "--llama-bench", "/bin/true", "--pair", f"int3={gguf}"])


def test_pocketllm_usage_error_is_one_line(capsys, monkeypatch):
    """A UsageError from pocketllm itself (here a bad POCKETLLM_ISA) is the script's one line."""
    monkeypatch.setenv("POCKETLLM_ISA", "avx3")
    line = refused(capsys, quant_kernels.main, ["--preset", "tiny", "--errors", "--no-timing"])
    assert line.startswith("quant_kernels.py: error: POCKETLLM_ISA='avx3'")


def test_checkpoint_dir_stops_when_make_checkpoint_fails(capsys):
    class Args:
        ckpt, preset, dtype = None, "nope", "bfloat16"

    with pytest.raises(SystemExit) as exc:
        common.checkpoint_dir(Args())
    assert exc.value.code == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_quantize_schemes_as_the_cli_reads_them():
    assert common.scheme_list("int8,int4,int4-g64-asym") == ["int8", "int4-g128", "int4-g64-asym"]
    assert common.scheme_list("") == []


def test_bench_path_flags_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = common.absolute_paths(["--ckpt", "tiny", "--max-new-tokens", "4", "--calibration=c.json"])
    assert got == ["--ckpt", os.path.join(str(tmp_path), "tiny"), "--max-new-tokens", "4", f"--calibration={tmp_path}/c.json"]


def test_ctrl_c_in_a_script_is_one_line_with_the_clis_status(capsys):
    """A script stopped by Ctrl-C says so in one line, exit 130, as the CLI does (serve_load's
    server is stopped and its temporary checkpoint removed on the way out)."""
    @common.script
    def main(argv=None):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 130
    assert capsys.readouterr().err.strip() == f"{Path(__file__).name}: interrupted"


def test_a_device_test_group_ends_with_its_whole_time_and_counts_a_failure_once(monkeypatch, tmp_path):
    """The check's budget pays a group's whole time (its process, collection, compiles), which its
    tests' own times leave out: a `total` row says it, and is not a second failure."""
    junit = ('<testsuites><testsuite><testcase classname="tests.device.test_a" name="t1" time="1.5"/>'
             '<testcase classname="tests.device.test_a" name="t2" time="0.5"><failure message="boom">x</failure></testcase>'
             '<testcase classname="tests.device.test_b" name="t3"><skipped message="no CUDA device"/></testcase></testsuite></testsuites>')

    def pytest_run(cmd, timeout, env=None):
        Path(next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1]).write_text(junit)
        return 1, "", "", 42.0

    monkeypatch.setattr(device_check, "_run", pytest_run)
    table = device_check.Table()
    device_check.device_tests(table, 100)
    assert table.rows[-1] == ("tests/device engine", "total", "1 passed, 1 failed, 1 skipped", 42.0)
    assert table.failed() == 1

"""`pocketllm gdn-bench` on a tiny shape: the kernels it compares agree, its table and JSON are what it
timed (on a clock the test drives), and a disagreeing kernel or a bad value fails it."""

from __future__ import annotations

import argparse
import json
import os
import re
import types

import pytest
import torch

from conftest import cli_env, run_cli
from pocketllm.bench import gdn_bench
from pocketllm.commands import gdn_bench as command
from pocketllm.errors import UsageError


def parse(*argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.spec_of(parser.parse_args(list(argv)))


TINY = ("--tokens", "130", "--reps", "2", "--key-heads", "2", "--value-heads", "4", "--head-dim", "32", "--threads", "1", "--device", "cpu")


def run_bench(capsys) -> tuple[int, list[str], str]:
    threads = torch.get_num_threads()
    try:
        rc = gdn_bench.main(parse(*TINY))
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    return rc, captured.out.strip().splitlines(), captured.err


# Milliseconds each kernel "takes" per rep on the test's clock: the bench's figures must be these.
FAKE_MS = {
    "pocketllm chunked": [10.0, 12.0],
    "pocketllm recurrent": [33.0, 27.0],
    "transformers chunk": [20.0, 24.0],
    "transformers recurrent": [60.0, 66.0],
}


def test_the_figures_are_the_interleaved_timings_of_kernels_that_agree(capsys, monkeypatch):
    # The kernels run for real (their outputs are compared); the clock the bench reads advances by
    # FAKE_MS as each one runs, so every figure it prints can be checked against what it timed.
    now, calls = [0.0], []
    real_variants = gdn_bench._variants

    def timed_variants(*args):
        def timed(name, fn):
            def call():
                calls.append(name)
                result = fn()
                ms = FAKE_MS[name]
                now[0] += ms[(len([c for c in calls if c == name]) - 2) % len(ms)] / 1e3
                return result

            return call

        return {name: timed(name, fn) for name, fn in real_variants(*args).items()}

    monkeypatch.setattr(gdn_bench, "_variants", timed_variants)
    monkeypatch.setattr(gdn_bench, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(gdn_bench, "measure_matmul_rates", lambda *a, **k: (50.0, 80.0))
    rc, lines, _ = run_bench(capsys)
    assert rc == 0
    names = list(FAKE_MS)
    # One warm-up call each, then rep-major: every kernel once per rep, in one order.
    assert calls == names + names + names
    # Every kernel is checked against pocketllm's recurrent one; transformers is installed here.
    verdicts = {line.split()[0] + " " + line.split()[1]: line.split()[-3] for line in lines if line.startswith("  ") and " out " in line}
    assert verdicts == {name: "ok" for name in names if name != "pocketllm recurrent"}
    table = {" ".join(line.split()[:2]): line.split()[2:] for line in lines if " ".join(line.split()[:2]) in FAKE_MS}
    chunked = 11.0  # the median of its reps
    for name, ms in FAKE_MS.items():
        med = sum(ms) / 2
        assert table[name] == [f"{med:.1f}", f"{min(ms):.1f}..{max(ms):.1f}", f"{med * 1e3 / (130 * 4):.3f}", f"{med / chunked:.2f}"], name
    flops = gdn_bench.matmul_flops(130, 2, 4, 32, 32, gdn_bench.DEFAULT_CHUNK_SIZE)
    assert f"chunked: {flops / 1e9:.2f} GFLOP of matmul at {flops / 11e-3 / 1e9:.1f} GFLOP/s (median rep)" in lines
    assert json.loads(lines[-1]) == {
        "device": "cpu", "device_kernel": None, "device_kernel_vs_chunked": None,
        "vs_transformers_chunk": round(22.0 / chunked, 3), "vs_recurrent": round(30.0 / chunked, 3),
        "matmul_rate_fraction": round(flops / 11e-3 / 1e9 / 50.0, 3),
    }


def test_a_kernel_that_disagrees_fails_the_run(capsys, monkeypatch):
    real = gdn_bench.gated_delta_rule_chunked

    def off_by_a_bit(*args, **kwargs):
        out, state = real(*args, **kwargs)
        return out * 1.01, state

    monkeypatch.setattr(gdn_bench, "gated_delta_rule_chunked", off_by_a_bit)
    rc, lines, err = run_bench(capsys)
    assert rc == 1 and "kernels disagree beyond tolerance" in err
    assert [line.split()[0] for line in lines if line.rstrip().endswith("(tol 2e-03)") and "FAIL" in line] == ["pocketllm"]


@pytest.mark.parametrize(
    "argv, word",
    [
        (("--tokens", "0"), "--tokens"),
        (("--key-heads", "4", "--value-heads", "6"), "--value-heads"),
        (("--dtype", "float8"), "float8"),
        (("--device", "foo"), "--device 'foo'"),
    ],
    ids=["tokens0", "heads-not-multiple", "unknown-dtype", "unknown-device"],
)
def test_bad_values_are_usage_errors(argv, word):
    with pytest.raises(UsageError, match=word) as info:
        gdn_bench.main(parse(*argv))
    assert "\n" not in str(info.value)


def test_transformers_rows_are_its_torch_forms_where_fla_is_installed(tmp_path):
    """gdn-bench on the CPU of a machine with fla (the cuda extra): transformers' rows are its torch
    forms, timed and agreeing, and nothing it says about falling back reaches the user (up to 5.17
    transformers called fla's kernels on the CPU tensors and the run failed). fla is a stand-in
    whose kernels refuse CPU tensors, as fla's Triton kernels do."""
    ops = tmp_path / "fla" / "ops" / "gated_delta_rule"
    ops.mkdir(parents=True)
    for d in (tmp_path / "fla", tmp_path / "fla" / "ops"):
        (d / "__init__.py").write_text("")
    (ops / "__init__.py").write_text(
        "def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False, **kwargs):\n"
        "    raise RuntimeError('fla stand-in: its kernels take device tensors only')\n"
        "fused_recurrent_gated_delta_rule = chunk_gated_delta_rule\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    r = run_cli("gdn-bench", *TINY, "--dtype", "float32", env=cli_env(PYTHONPATH=path))
    assert r.returncode == 0, r.stderr
    assert "falling back" not in r.stderr, r.stderr
    for row in ("transformers chunk", "transformers recurrent"):
        assert re.search(rf"^  {row} .* ok \(tol", r.stdout, re.M), r.stdout

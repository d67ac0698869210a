"""`pocketllm gdn-bench` end to end on a tiny shape: kernels agree and the last line is the JSON."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

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


def test_tiny_run_agrees_and_its_json_says_what_its_table_does(capsys):
    rc, lines, _ = run_bench(capsys)
    assert rc == 0
    summary = json.loads(lines[-1])
    # Every kernel is checked against pocketllm's recurrent one; transformers is installed here.
    verdicts = [line.split()[-3] for line in lines if line.startswith("  ") and " out " in line]
    assert verdicts == ["ok"] * 3
    # The JSON ratio is the table's "x chunked" column for the recurrent kernel.
    (row,) = [line for line in lines if line.startswith("pocketllm recurrent")]
    assert float(row.split()[-1]) == pytest.approx(summary["vs_recurrent"], abs=0.006)
    assert summary["device"] == "cpu" and summary["device_kernel"] is None


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


def test_device_check_without_the_device_says_so_and_exits_2(capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check", path)
    device_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device_check)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_check.main(["--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == ["device_check: no cuda device is visible to torch; nothing to check"]
    assert captured.out.startswith("python ") and f"torch {torch.__version__}" in captured.out

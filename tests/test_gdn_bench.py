"""`pocketllm gdn-bench` end to end on a tiny shape: kernels agree and the last line is the JSON."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pocketllm.bench import gdn_bench
from pocketllm.errors import UsageError


def parse(*argv):
    parser = argparse.ArgumentParser()
    gdn_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_tiny_run_prints_json_summary_last(capsys):
    args = parse("--tokens", "130", "--reps", "2", "--key-heads", "2", "--value-heads", "4",
                 "--head-dim", "32", "--threads", "1", "--device", "cpu")
    threads = torch.get_num_threads()
    try:
        assert gdn_bench.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert set(summary) == {"device", "device_kernel", "device_kernel_vs_chunked", "vs_transformers_chunk", "vs_recurrent", "matmul_rate_fraction"}
    assert summary["device"] == "cpu" and summary["device_kernel"] is None
    assert summary["vs_recurrent"] > 0 and summary["matmul_rate_fraction"] > 0


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

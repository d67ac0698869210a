"""`pocketllm bench --limits`: the run's figures set against the machine's memory and matmul rates,
measured after the run, in rank 0's notes and the JSON."""

from __future__ import annotations

import json

import pytest
from conftest import main_in_process

from pocketllm.bench import limits
from pocketllm.presets import get_preset


@pytest.mark.timeout(120)
def test_bench_prints_and_writes_each_figures_share_of_its_limit(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main_in_process("bench", "--preset", "tiny", "--prompt-tokens", 32, "--max-new-tokens", 4, "--warmup-tokens", 4, "--limits", "--json", out) == 0
    err = capsys.readouterr().err
    doc = json.loads(out.read_text())
    s = doc["limits"]
    assert s["memory_gbps"] > 0 and s["matmul_tflops"] > 0
    # The shares are the run's own rates over the limits, recomputed here from the figures.
    steps_per_s = doc["decode_tokens"] / doc["decode_seconds"]
    assert s["decode_share_of_memory_limit"] == pytest.approx(steps_per_s / s["decode_steps_per_s_limit"], rel=1e-2, abs=1e-4)
    assert s["prefill_share_of_matmul_limit"] == pytest.approx(
        s["prefill_gemm_flops"] / (s["matmul_tflops"] * 1e12) / doc["prefill_seconds"], rel=2e-2, abs=1e-4
    )
    assert "limits: a decode step reads" in err


def test_a_steps_weight_bytes_and_a_prefills_flops_count_what_the_model_holds(tmp_path):
    from conftest import tiny_engine

    model = tiny_engine().model
    cfg = get_preset("tiny")
    weights = model.projection_weights()
    # Every projection and the head read once a step; of the embedding table, one row.
    projections = sum(w.numel() * w.element_size() for w in weights)
    assert limits.decode_weight_bytes(model) > projections
    assert limits.decode_weight_bytes(model) < projections + cfg.vocab_size * cfg.hidden_size * 4
    head = weights[-1].numel()
    assert limits.prefill_gemm_flops(model, 10) == 2 * 10 * (sum(w.numel() for w in weights) - head) + 2 * head


def test_a_bench_timed_on_a_busy_machine_says_its_figures_are_low(tmp_path, capsys, monkeypatch):
    """What the window's load monitor (ops.registry.trust, tested with real busy loops in
    test_registry) found while the figures were timed goes into the JSON, and a busy machine is a
    note on stderr. Here the monitor's verdict is set, so the test does not depend on this
    machine's own load."""
    from pocketllm.ops.registry import trust

    out = tmp_path / "bench.json"
    verdicts = []

    def stop(self, started):
        verdicts.append(trust.Verdict(True, 0.42, 0.01, 1.0))
        return verdicts[-1]

    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(trust.Monitor, "stop", stop)
        assert main_in_process("bench", "--preset", "tiny", "--prompt-tokens", 16, "--max-new-tokens", 4, "--json", out) == 0
    err = capsys.readouterr().err
    assert json.loads(out.read_text())["machine_load"] == {"others_share": 0.42, "steal_share": 0.01, "busy": True}
    assert "note: the machine was busy while the figures were timed (other processes took 42% of the CPUs, 1% stolen)" in err, err

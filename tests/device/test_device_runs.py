"""Whole runs on the device: transformers as the oracle (on CPU, fp32) for pocketllm's logits on
the device, and the resident bench at TP=1 and, where there are two devices, TP=2 over NCCL/HCCL."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from device_caps import fla_installed, npu_op_present, on_devices
from oracle_runs import PROMPT, generate_logits as _logits, oracle_model, saved

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import run_cli  # noqa: E402
from hf_oracle import hf_greedy, hf_prefill_logits  # noqa: E402


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    model = oracle_model()
    ckpt = saved(model, tmp_path_factory.mktemp("oracle"))
    return ckpt, hf_prefill_logits(model, PROMPT), hf_greedy(model, PROMPT, 8)


@on_devices()
def test_float32_on_the_device_matches_transformers(oracle, kind, tmp_path):
    ckpt, ref_logits, ref_tokens = oracle
    logits, tokens, _ = _logits(ckpt, kind, "float32", tmp_path, "fp32")
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-2)
    assert tokens == ref_tokens


@on_devices()
def test_bfloat16_on_the_device_is_as_close_to_transformers_as_on_cpu(oracle, kind, tmp_path):
    ckpt, ref_logits, _ = oracle
    device_logits, _, stderr = _logits(ckpt, kind, "bfloat16", tmp_path, "device")
    cpu_logits, _, _ = _logits(ckpt, "cpu", "bfloat16", tmp_path, "cpu")
    expected = "fla" if kind == "cuda" and fla_installed() else "npu" if kind == "npu" and npu_op_present() else "chunk"
    assert f"gdn kernel: {expected} " in stderr, stderr
    err = lambda x: (x - ref_logits).abs().max().item()  # noqa: E731
    # Two bf16 implementations differ by bf16 rounding; the device's may not be far worse.
    assert err(device_logits) <= 2 * err(cpu_logits) + 1e-2, (err(device_logits), err(cpu_logits))


def _bench(kind, world: int, tmp_path):
    out = tmp_path / f"bench-tp{world}.json"
    r = run_cli("bench", "--preset", "tiny", "--device", kind, "--tp-world", world, "--prompt-tokens", 256, "--max-new-tokens", 8,
                "--dist-timeout", 120, "--json", out, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@on_devices()
def test_bench_at_tp1_on_the_device(kind, tmp_path):
    doc = _bench(kind, 1, tmp_path)
    assert doc["prefill_tokens_per_s"] > 0 and doc["decode_tokens_per_s"] > 0
    assert doc["settings"]["gdn_kernel"] in ("fla", "npu", "chunk")


@on_devices(min_count=2)
def test_bench_at_tp2_over_the_device_backend(kind, tmp_path):
    doc = _bench(kind, 2, tmp_path)
    assert doc["settings"]["backend"] == {"cuda": "nccl", "npu": "hccl"}[kind]
    assert doc["collectives"] > 0


@on_devices()
def test_a_presets_weights_are_drawn_on_the_device(kind):
    # The preset's tensors come from the device's own generator: nothing of their size crosses
    # the host, and the same seed draws the same tensor twice.
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    rw = RandomWeights(get_preset("small"), dtype=torch.bfloat16, device=kind)
    key = "model.layers.0.mlp.gate_proj.weight"
    a, b = rw.get_slice(key)[:], RandomWeights(get_preset("small"), dtype=torch.bfloat16, device=kind).get_slice(key)[:]
    assert a.device.type == kind and torch.equal(a, b)
    assert a.float().std().item() > 0

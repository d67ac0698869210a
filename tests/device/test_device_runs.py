"""Whole runs on the device: transformers as the oracle (on CPU, fp32) for pocketllm's logits on
the device, and the resident bench at TP=1 and, where there are two devices, TP=2 over NCCL/HCCL."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from device_caps import fla_installed, npu_op_present, on_devices

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import generated_ids, run_cli  # noqa: E402
from hf_oracle import build_hf_model, hf_greedy, hf_prefill_logits, save_hf_checkpoint  # noqa: E402

PROMPT = [(7 * i + 3) % 200 for i in range(70)]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    model = build_hf_model(vocab=251, kv_heads=1)
    ckpt = save_hf_checkpoint(model, tmp_path_factory.mktemp("oracle"))
    return ckpt, hf_prefill_logits(model, PROMPT), hf_greedy(model, PROMPT, 8)


def _logits(ckpt, device: str, dtype: str, tmp_path, name: str, *flags):
    out = tmp_path / f"{name}.safetensors"
    r = run_cli("generate", "--ckpt", ckpt, "--device", device, "--dtype", dtype, "--token-ids", ",".join(map(str, PROMPT)),
                "--max-new-tokens", 8, "--logits-out", out, *flags, timeout=300)
    assert r.returncode == 0, r.stderr
    return load_file(str(out))["logits"], generated_ids(r.stdout), r.stderr


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


@on_devices()
@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_a_quantized_run_on_the_device_gives_the_cpus_numbers(oracle, kind, scheme, tmp_path):
    """Off the CPU quantized weights run as their dequantized values in the run's dtype: in fp32,
    the logits of the CPU's quantized kernels up to the order of their sums, and its tokens."""
    ckpt = oracle[0]
    device_logits, device_tokens, stderr = _logits(ckpt, kind, "float32", tmp_path, "device", "--quantize", scheme)
    cpu_logits, cpu_tokens, _ = _logits(ckpt, "cpu", "float32", tmp_path, "cpu", "--quantize", scheme)
    assert f"dequantized to torch.float32 on {kind}" in stderr, stderr
    torch.testing.assert_close(device_logits, cpu_logits, atol=1e-4, rtol=1e-4)
    assert device_tokens == cpu_tokens


@on_devices()
def test_a_seeded_sample_on_the_device_is_the_same_twice(oracle, kind, tmp_path):
    """Sampling on the host from the device's logits (the sampled rows copied at once a step),
    each request's own generator: a seed gives its tokens again, and they are the vocabulary's."""
    ckpt = oracle[0]
    runs = [_logits(ckpt, kind, "float32", tmp_path, f"sampled{i}", "--temperature", "0.9", "--top-p", "0.95", "--seed", 3)
            for i in range(2)]
    (_, first, _), (_, second, _) = runs
    assert first == second and len(first) == 8 and all(0 <= t < 251 for t in first), (first, second)


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
def test_tp2_over_the_device_backend_gives_tp1s_numbers(oracle, kind, tmp_path):
    """fp32 at TP=2 over NCCL/HCCL, each row-parallel projection cut into 4 slices whose
    all-reduces overlap the next slice's GEMM (the seed's path, async on the device's streams):
    TP=1's logits up to the order of the sums, and its tokens."""
    ckpt = oracle[0]
    one, one_tokens, _ = _logits(ckpt, kind, "float32", tmp_path, "tp1")
    two, two_tokens, _ = _logits(ckpt, kind, "float32", tmp_path, "tp2", "--tp-world", 2, "--pin-slices", 4, "--dist-timeout", 120)
    torch.testing.assert_close(two, one, atol=1e-4, rtol=1e-4)
    assert two_tokens == one_tokens


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

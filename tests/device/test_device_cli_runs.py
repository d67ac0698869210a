"""More whole runs of `pocketllm generate` on the device, each against the same command's own numbers
elsewhere: a quantized run against the CPU's quantized kernels, a seeded sample against itself, and
TP=2 over NCCL/HCCL with overlapped slices against TP=1. benchmarks/device_check.py runs this file
after its figures (the runs against transformers come first, in test_device_runs.py)."""

from __future__ import annotations

import pytest
import torch

from device_caps import on_devices
from oracle_runs import VOCAB, generate_logits as _logits, oracle_model, saved


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """The oracle's checkpoint (transformers wrote it), in a tuple as test_device_runs.py's."""
    return (saved(oracle_model(), tmp_path_factory.mktemp("oracle")),)


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
    assert first == second and len(first) == 8 and all(0 <= t < VOCAB for t in first), (first, second)


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

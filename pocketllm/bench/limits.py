"""The physical limits a bench figure is set against, measured on the machine that runs: how fast
its memory moves bytes (a decode step has to read every weight once) and how fast it multiplies
matrices (a prefill's projections are GEMMs). `pocketllm bench --limits` prints each of its
figures as a share of the limit beside it.

On a CPU the memory rate is a read (an fp32 sum over a buffer far beyond cache, on huge pages as
the engine's weights are, as a decode step streams them); on a device the faster of a
device-to-device copy, counting the bytes read and written, and an fp32 sum (a read alone, as a
decode step's: a device's memory may read faster than it mixes reads and writes). Each is the
best of a few runs, so a moment's disturbance does not lower the limit. Weights that fit in a CPU's last-level cache read faster
than memory: a small model's share of this limit can pass 100%."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pocketllm import host_memory


@dataclass(frozen=True)
class Limits:
    memory_gbps: float  # bytes a second, in 1e9
    memory_how: str  # what was timed
    matmul_tflops: float  # multiply-adds x 2 a second, in 1e12
    matmul_how: str


def measure(device: torch.device, dtype: torch.dtype, sync, quick: bool = False) -> Limits:
    """The machine's memory and matmul rates on `device` for weights of `dtype`. quick: smaller
    buffers and matrices (a dry run; the rates read lower)."""
    if device.type == "cpu":
        mib, reps = (64 if quick else 1024), 5
        x = host_memory.zeros((mib * 2**20 // 4,), torch.float32).fill_(1)
        seconds = _best(lambda: x.sum(), sync, reps)
        memory, how = x.nbytes / seconds / 1e9, f"fp32 sum of {mib} MiB on huge pages where the host has them, best of {reps}"
        n = 256 if quick else 1024
    else:
        mib, reps = (64 if quick else 2048), 10
        src = torch.zeros(mib * 2**20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        words = src.view(torch.float32)
        copy = 2 * src.nbytes / _best(lambda: dst.copy_(src), sync, reps) / 1e9
        read = src.nbytes / _best(lambda: words.sum(), sync, reps) / 1e9
        memory = max(copy, read)
        how = f"the faster of a copy of {mib} MiB, read + written ({copy:.0f} GB/s), and an fp32 sum of it ({read:.0f} GB/s), best of {reps} each"
        n = 1024 if quick else 8192
    # A CPU without native arithmetic in the weights' dtype runs a prefill's GEMMs widened to fp32
    # (the many-row kind's mm-f32): the limit is the faster of the two there. Each is tried small
    # first, and one far slower there is not timed at the full size: on an AVX2 CPU torch's bf16
    # GEMM ran ~60x slower than fp32, seconds a call at 1024^3, and could not have been the limit.
    dtypes = (dtype, torch.float32) if device.type == "cpu" and dtype != torch.float32 else (dtype,)
    probe = {dt: _matmul_rate(device, dt, min(n, 256), sync, 1) for dt in dtypes} if len(dtypes) > 1 else {dtype: 0.0}
    rates = {dt: _matmul_rate(device, dt, n, sync, 5) for dt in dtypes if probe[dt] * 4 >= max(probe.values())}
    best = max(rates, key=rates.get)
    return Limits(memory, how, rates[best], f"{str(best).removeprefix('torch.')} {n}^3 matmul, best of 5")


def _matmul_rate(device: torch.device, dt: torch.dtype, n: int, sync, reps: int) -> float:
    """An n^3 matmul's rate in `dt` on `device`, TFLOP/s, the best of `reps` after a warm-up."""
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    return 2 * n**3 / _best(lambda: a @ b, sync, reps) / 1e12


def _best(fn, sync, reps: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step of one sequence reads: every parameter except the
    embedding table, of which a step reads one row (a tied head reads it whole, as the head), and
    every quantized projection weight (values, scales, zero points)."""
    total = 0
    # named_parameters lists a tied head's shared weight once.
    for name, p in model.named_parameters():
        if "embed" in name and not model.cfg.tie_word_embeddings:
            total += p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total + sum(w.nbytes for w in model.projection_weights() if not isinstance(w, torch.Tensor))


def prefill_gemm_flops(model, rows: int) -> int:
    """FLOPs of a prefill's GEMMs over `rows` rows: every projection on every row (2 per
    multiply-add), the head on one row per sequence (counted as one)."""
    weights = model.projection_weights()
    head = weights[-1]
    per_row = sum(w.shape[0] * w.shape[1] for w in weights[:-1])
    return 2 * rows * per_row + 2 * head.shape[0] * head.shape[1]


def shares(limits: Limits, model, result: dict) -> dict:
    """The result's figures against the limits: the fastest decode the memory rate allows (one
    read of the step's weights a step, for the whole batch), the fastest prefill the matmul rate
    allows, and the run's share of each."""
    step_bytes = decode_weight_bytes(model)
    decode_steps_per_s = result["decode_tokens"] / result["decode_seconds"] / result.get("batch", 1)
    decode_limit = limits.memory_gbps * 1e9 / step_bytes
    flops = prefill_gemm_flops(model, result["prefill_tokens"])
    prefill_limit_s = flops / (limits.matmul_tflops * 1e12)
    return {
        "memory_gbps": float(f"{limits.memory_gbps:.4g}"),
        "memory_rate": limits.memory_how,
        "matmul_tflops": float(f"{limits.matmul_tflops:.4g}"),
        "matmul_rate": limits.matmul_how,
        "decode_step_weight_bytes": step_bytes,
        "decode_steps_per_s_limit": round(decode_limit, 2),
        "decode_share_of_memory_limit": round(decode_steps_per_s / decode_limit, 4),
        "prefill_gemm_flops": flops,
        "prefill_share_of_matmul_limit": round(prefill_limit_s / result["prefill_seconds"], 4),
    }


def describe(s: dict) -> str:
    """One line for rank 0's notes."""
    return (
        f"limits: a decode step reads {s['decode_step_weight_bytes'] / 2**20:.0f} MiB of weights, at {s['memory_gbps']:g} GB/s "
        f"({s['memory_rate']}) at most {s['decode_steps_per_s_limit']:g} steps/s: this run {100 * s['decode_share_of_memory_limit']:.0f}%; "
        f"the prefill's GEMMs are {s['prefill_gemm_flops'] / 1e12:.3g} TFLOP, at {s['matmul_tflops']:g} TFLOP/s ({s['matmul_rate']}): "
        f"this run {100 * s['prefill_share_of_matmul_limit']:.0f}%"
    )

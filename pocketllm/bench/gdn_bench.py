"""`pocketllm gdn-bench` (its flags: pocketllm/commands/gdn_bench.py): time the gated delta rule
kernels on one layer's shapes.

Runs pocketllm's chunked and per-token kernels, the device kernel the engine would run on
--device (fla on CUDA, torch_npu's op on Ascend, where installed and the dtype allows) and, when
transformers is importable, its torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule
(its torch forms, on any device: bench/transformers_model.py),
interleaved rep-major on the same seeded inputs; checks they agree; prints a table and, last, one
JSON line with the ratios. On a device every timing is between two synchronisations.
The achieved rate counts the chunked algorithm's real matmul FLOPs and is set against this
machine's batched-matmul rate measured at the chunk's shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pocketllm.bench import transformers_model
from pocketllm.device import DeviceInfo
from pocketllm.model_args import parse_dtype
from pocketllm.ops.gated_delta.backends import select_gdn_kernel
from pocketllm.ops.gated_delta.chunked import DEFAULT_CHUNK_SIZE, gated_delta_rule_chunked, matmul_flops
from pocketllm.ops.gated_delta.recurrent import gated_delta_rule_recurrent
from pocketllm.run_plan import DevicePlan

# Worst relative error (max |diff| / max |reference|) accepted between kernels, per input dtype.
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def add_head_arguments(parser: argparse.ArgumentParser) -> None:
    """The head shape of the inputs; the defaults are one TP=4 rank of the 27B model. Shared with
    benchmarks/chunk_size.py, which times the chunked kernel on the same inputs."""
    parser.add_argument("--key-heads", type=int, default=4, help="key heads Hk (default 4: 27B at TP4)")
    parser.add_argument("--value-heads", type=int, default=12, help="value heads Hv (default 12)")
    parser.add_argument("--head-dim", type=int, default=128, help="key and value head dim (default 128)")


@dataclass(frozen=True)
class GdnBenchSpec:
    """What `pocketllm gdn-bench` times: the shape, the dtype, the resolved device and the reps."""

    device: DevicePlan
    tokens: int = 4096
    key_heads: int = 4
    value_heads: int = 12
    head_dim: int = 128
    dtype: str = "float32"
    reps: int = 5
    threads: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE


def check_heads(key_heads: int, value_heads: int) -> None:
    """The head arguments (add_head_arguments) as the kernels take them: a usage error otherwise.
    Shared with benchmarks/chunk_size.py, like the arguments."""
    from pocketllm.errors import UsageError

    if key_heads < 1 or value_heads < 1 or value_heads % key_heads:
        raise UsageError(f"--value-heads ({value_heads}) must be a positive multiple of --key-heads ({key_heads})")


def _validate(spec: GdnBenchSpec) -> torch.dtype:
    from pocketllm.errors import UsageError

    if spec.tokens < 1:
        raise UsageError(f"--tokens must be >= 1; got {spec.tokens}")
    check_heads(spec.key_heads, spec.value_heads)
    if spec.head_dim < 1 or spec.reps < 1 or spec.chunk_size < 1:
        raise UsageError(
            f"--head-dim, --reps and --chunk-size must be >= 1; got {spec.head_dim}, {spec.reps}, {spec.chunk_size}"
        )
    if spec.threads is not None and spec.threads < 1:
        raise UsageError(f"--threads must be >= 1; got {spec.threads}")
    return parse_dtype(spec.dtype)


def make_inputs(T: int, Hk: int, Hv: int, D: int, dtype: torch.dtype, seed: int = 0, Dv: int | None = None):
    """Seeded inputs shaped like one GDN layer's kernel call: q, k l2-normalised, q scaled by
    D**-0.5; v of head size Dv (default D); g from the model's own gate formula
    -exp(A_log) * softplus(a + dt_bias) at its initialisation ranges (A in [1, 16], dt in
    [1e-3, 1e-1]), clamped to [-5, 0]; beta in (0, 1). The kernel tests draw theirs here too."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, Hk, D, generator=gen), dim=-1) * D**-0.5
    k = torch.nn.functional.normalize(torch.randn(T, Hk, D, generator=gen), dim=-1)
    v = torch.randn(T, Hv, D if Dv is None else Dv, generator=gen)
    A = torch.empty(Hv).uniform_(1.0, 16.0, generator=gen)
    dt = torch.empty(Hv).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    # softplus(dt_bias) == dt
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    a = torch.randn(T, Hv, generator=gen)
    g = (-A * torch.nn.functional.softplus(a + dt_bias)).clamp(min=-5.0)
    beta = torch.sigmoid(torch.randn(T, Hv, generator=gen))
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


def _best_rate(fn, flops: float, reps: int, sync) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    # The best rep: on a shared machine that is the closest to what the hardware can do, so the
    # fraction a kernel reaches of it errs low rather than high.
    return flops / min(times) / 1e9


def measure_matmul_rates(Hv: int, T: int, D: int, chunk: int, reps: int = 5, device: DeviceInfo = DeviceInfo("cpu", 0)) -> tuple[float, float]:
    """This machine's torch.bmm GFLOP/s at the kernel's shapes: all chunks at once,
    [Hv * nchunks, C, Dk] x [Hv * nchunks, Dk, Dv] (the reference for the rate fraction), and one
    chunk's pass, [Hv, C, Dk] x [Hv, Dk, Dv] repeated on cache-resident operands (for context)."""
    nchunks = -(-T // chunk)
    batch = Hv * nchunks
    dev, sync = device.torch_device, device.synchronize
    a, b, out = (torch.randn(*s).to(dev) for s in ((batch, chunk, D), (batch, D, D), (batch, chunk, D)))
    all_chunks = _best_rate(lambda: torch.bmm(a, b, out=out), 2.0 * batch * chunk * D * D, reps, sync)
    a, b, out = a[:Hv].clone(), b[:Hv].clone(), out[:Hv].clone()

    def per_chunk():
        for _ in range(nchunks):
            torch.bmm(a, b, out=out)

    one_chunk = _best_rate(per_chunk, 2.0 * batch * chunk * D * D, reps, sync)
    return all_chunks, one_chunk


def _variants(spec: GdnBenchSpec, inputs, device_kernel=None):
    q, k, v, g, beta = inputs
    C = spec.chunk_size
    variants = {
        "pocketllm chunked": lambda: gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=C),
        "pocketllm recurrent": lambda: gated_delta_rule_recurrent(q, k, v, g, beta),
    }
    if device_kernel is not None:
        variants[f"device {device_kernel.name}"] = lambda: device_kernel.prefill(q, k, v, g, beta, None)
    try:
        hf = transformers_model.modeling(fla=False)
    except ImportError:
        return variants
    # transformers takes [B, T, H, D] and always scales q by Dk**-0.5 itself, so it gets the
    # unscaled (still normalised) q. q and k go at value heads, each key head repeated for its
    # group, as its layer passes them up to 5.17 (later releases group them in the function, and
    # take them repeated alike).
    groups = v.shape[1] // k.shape[1]
    q_hf = (q.float() * q.shape[-1] ** 0.5).to(q.dtype).repeat_interleave(groups, dim=1)[None]
    k_hf, v_hf, g_hf, b_hf = k.repeat_interleave(groups, dim=1)[None], v[None], g[None], beta[None]

    def transformers_call(fn):
        def call():
            out, state = fn(q_hf, k_hf, v_hf, g=g_hf, beta=b_hf, initial_state=None, output_final_state=True)
            return out[0], state[0]

        return call

    variants["transformers chunk"] = transformers_call(hf.torch_chunk_gated_delta_rule)
    variants["transformers recurrent"] = transformers_call(hf.torch_recurrent_gated_delta_rule)
    return variants


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (x.float() - ref.float()).abs().max().item()
    return diff, diff / max(ref.float().abs().max().item(), 1e-30)


def _time_interleaved(variants, reps: int, sync):
    """Rep-major: every kernel once per rep, so a slow patch of a shared machine hits them all."""
    times = {name: [] for name in variants}
    results = {}
    for rep in range(reps):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            results[name] = fn()
            sync()
            times[name].append(time.perf_counter() - start)
        print(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in variants),
              file=sys.stderr)
    return times, results


def _check_agreement(results, tolerance: float) -> bool:
    ref_out, ref_state = results["pocketllm recurrent"]
    agree = True
    print("agreement with pocketllm recurrent (max abs err, relative to max |ref|):")
    for name, (out, state) in results.items():
        if name == "pocketllm recurrent":
            continue
        out_abs, out_rel = _relative_error(out, ref_out)
        state_abs, state_rel = _relative_error(state, ref_state)
        ok = out_rel <= tolerance and state_rel <= tolerance
        agree &= ok
        print(f"  {name:24s} out {out_abs:.2e} ({out_rel:.1e})  state {state_abs:.2e} ({state_rel:.1e})  "
              f"{'ok' if ok else 'FAIL'} (tol {tolerance:.0e})")
    return agree


def main(spec: GdnBenchSpec) -> int:
    dtype = _validate(spec)
    kind = spec.device.kind
    device = DeviceInfo(kind, (spec.device.index or 0) if kind != "cpu" else 0)
    if device.kind == "cuda":
        torch.cuda.set_device(device.index)
    elif device.kind == "npu":
        torch.npu.set_device(device.index)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    T, Hk, Hv, D = spec.tokens, spec.key_heads, spec.value_heads, spec.head_dim
    C = min(spec.chunk_size, T)
    kernel = select_gdn_kernel(device.torch_device, dtype, layout=(Hk, Hv, D, D))
    device_kernel = kernel if kernel.name in ("fla", "npu") else None
    print(f"gdn-bench: T={T} Hk={Hk} Hv={Hv} D={D} dtype={spec.dtype} chunk={spec.chunk_size} device={device.describe()} "
          f"threads={torch.get_num_threads()} reps={spec.reps}; engine's kernel here: {kernel.describe()}", file=sys.stderr)

    def inputs(seed):
        return tuple(x.to(device.torch_device) for x in make_inputs(T, Hk, Hv, D, dtype, seed=seed))

    try:
        variants = _variants(spec, inputs(0), device_kernel)
        # Warm every kernel at the timed shape, so first-call and per-shape costs stay out of the timings.
        # transformers says once, at a torch form's first call, that it fell back to it: here that
        # form is what its row times.
        with transformers_model.torch_forms_called_quietly():
            for fn in _variants(spec, inputs(1), device_kernel).values():
                fn()
        times, results = _time_interleaved(variants, spec.reps, device.synchronize)
    except RuntimeError as exc:  # torch.OutOfMemoryError (a device's) is one
        if not isinstance(exc, torch.OutOfMemoryError) and "DefaultCPUAllocator" not in str(exc):
            raise
        from pocketllm.errors import UsageError

        raise UsageError(f"--tokens {T} with these heads does not fit in {device.describe()}'s memory ({str(exc).splitlines()[0]})") from None
    agree = _check_agreement(results, TOLERANCE[dtype])

    chunked = statistics.median(times["pocketllm chunked"])
    flops = matmul_flops(T, Hk, Hv, D, D, spec.chunk_size)
    achieved = flops / chunked / 1e9
    rate, pass_rate = measure_matmul_rates(Hv, T, D, C, device=device)
    print(f"{'kernel':24s} {'median ms':>10s} {'min..max ms':>19s} {'us/tok/head':>12s} {'x chunked':>10s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = f"{min(ts) * 1e3:.1f}..{max(ts) * 1e3:.1f}"
        print(f"{name:24s} {med * 1e3:10.1f} {spread:>19s} {med * 1e6 / (T * Hv):12.3f} {med / chunked:10.2f}")
    print(f"chunked: {flops / 1e9:.2f} GFLOP of matmul at {achieved:.1f} GFLOP/s (median rep)")
    print(f"machine bmm, all chunks [{Hv}*{-(-T // C)}, {C}, {D}]x[{D}, {D}]: {rate:.1f} GFLOP/s "
          f"-> chunked reaches {achieved / rate:.0%}")
    print(f"machine bmm, one chunk's pass [{Hv}, {C}, {D}]x[{D}, {D}] in cache: {pass_rate:.1f} GFLOP/s "
          f"-> chunked reaches {achieved / pass_rate:.0%}")

    hf_chunk = times.get("transformers chunk")
    on_device = times.get(f"device {kernel.name}")
    summary = {
        "device": device.kind,
        "device_kernel": device_kernel.name if device_kernel else None,
        "device_kernel_vs_chunked": round(statistics.median(on_device) / chunked, 3) if on_device else None,
        "vs_transformers_chunk": round(statistics.median(hf_chunk) / chunked, 3) if hf_chunk else None,
        "vs_recurrent": round(statistics.median(times["pocketllm recurrent"]) / chunked, 3),
        "matmul_rate_fraction": round(achieved / rate, 3),
    }
    if not agree:
        print("gdn-bench: kernels disagree beyond tolerance", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if agree else 1

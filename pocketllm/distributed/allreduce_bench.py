"""What one TP all-reduce costs on the machine at hand: time it per payload size, and fit
time = fixed + bytes / bandwidth, the two terms the slice count trades (seed section 2)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from pocketllm.distributed import collective, waiting

@dataclass
class Fit:
    fixed_us: float
    bandwidth_GBps: float  # math.inf when the byte term is not measurable
    max_rel_err: float

    def predict_us(self, nbytes: float) -> float:
        return self.fixed_us + nbytes / (self.bandwidth_GBps * 1e3)

    def line(self) -> str:
        return f"fixed_us={self.fixed_us:.2f} bandwidth_GBps={self.bandwidth_GBps:.3f} max_rel_err={self.max_rel_err:.3f}"

    def note(self) -> str | None:
        """What an unmeasurable byte term means, for the line under the fit (its key=value line
        stays parseable)."""
        if math.isinf(self.bandwidth_GBps):
            return ("note: bandwidth_GBps=inf: the larger payloads took no longer than the smaller, so the byte term is "
                    "not measurable here (too few or too close sizes, or a noisy run); fixed_us is the mean time")
        return None

    def to_json(self) -> dict:
        # JSON has no infinity: an unmeasurable byte term is null.
        return {**asdict(self), "bandwidth_GBps": None if math.isinf(self.bandwidth_GBps) else self.bandwidth_GBps}


def fit_latency_bandwidth(nbytes: list[float], times_us: list[float]) -> Fit:
    """Least squares for time = fixed + bytes / bandwidth, minimising the relative error: a plain
    fit would let the largest payloads (milliseconds) drown the fixed term the small ones (microseconds)
    measure, and the fixed term is the number the slice count turns on."""
    if len(nbytes) != len(times_us) or len(nbytes) < 2:
        raise ValueError("the fit needs at least two (bytes, time) points")
    if len(set(nbytes)) < 2:
        raise ValueError("the fit needs at least two distinct payload sizes")
    # Weighted normal equations for t = a + b*x with weights 1/t^2.
    w = [1.0 / (t * t) for t in times_us]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, nbytes))
    sy = sum(wi * t for wi, t in zip(w, times_us))
    sxx = sum(wi * x * x for wi, x in zip(w, nbytes))
    sxy = sum(wi * x * t for wi, x, t in zip(w, nbytes, times_us))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det  # us per byte
    fixed = (sy - slope * sx) / sw
    if slope > 0 and fixed < 0:
        # A line that would take negative time at zero bytes (noise, or sizes all far above the
        # fixed cost): no latency is less than none, so the byte term alone, fixed held at zero.
        slope, fixed = sxy / sxx, 0.0
    if slope > 0:
        bandwidth = 1.0 / (slope * 1e3)  # bytes/us -> GB/s
    else:
        # Time that does not grow with the bytes (noise over a few small sizes): the fixed term
        # alone, fitted with the byte term held at zero, not the intercept of a falling line.
        fixed, bandwidth = sy / sw, math.inf
    fit = Fit(fixed, bandwidth, 0.0)
    fit.max_rel_err = max(abs(fit.predict_us(x) - t) / t for x, t in zip(nbytes, times_us))
    return fit


@dataclass
class SizeResult:
    size_bytes: int
    count: int
    dtype: str
    time_us: float
    device_us: float
    algbw_GBps: float
    busbw_GBps: float


def bus_factor(world: int) -> float:
    """nccl-tests' busbw correction for all-reduce: each byte crosses 2(n-1)/n links."""
    return 2.0 * (world - 1) / world


def _event_pair(kind: str):
    if kind == "cuda":
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if kind == "npu":
        return torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    return None


def max_over_ranks(values: list[float]) -> list[float]:
    """The slowest rank's figure for each value, all in one all-reduce: a collective is as slow as
    its last participant."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_allreduce(size_bytes: int, dtype: torch.dtype, device, iters: int, warmup: int, world: int) -> SizeResult:
    """Mean wall time per call of `iters` back-to-back all-reduces after `warmup` untimed ones,
    the device synchronised at both ends; device events alongside on CUDA/NPU."""
    elem = dtype.itemsize
    count = size_bytes // elem
    buf = torch.ones(count, dtype=dtype, device=device.torch_device)
    # Started and waited for as the engine does (pocketllm.distributed.collective and .waiting),
    # so the fit prices the all-reduce the engine runs, shm or gloo.
    for _ in range(warmup):
        waiting.wait(collective.start_all_reduce(buf))
    device.synchronize()
    dist.barrier()
    events = _event_pair(device.kind)
    t0 = time.perf_counter()
    if events:
        events[0].record()
    for _ in range(iters):
        waiting.wait(collective.start_all_reduce(buf))
    if events:
        events[1].record()
    device.synchronize()
    wall_us = (time.perf_counter() - t0) / iters * 1e6
    device_us = events[0].elapsed_time(events[1]) * 1e3 / iters if events else wall_us
    wall_us, device_us = max_over_ranks([wall_us, device_us])
    nbytes = count * elem
    algbw = nbytes / (wall_us * 1e3)
    return SizeResult(nbytes, count, str(dtype).removeprefix("torch."), wall_us, device_us, algbw, algbw * bus_factor(world))


COLUMNS = ("size_bytes", "count", "dtype", "time_us", "device_us", "algbw_GBps", "busbw_GBps")


def format_table(rows: list[SizeResult]) -> list[str]:
    lines = ["{:>12} {:>11} {:>9} {:>11} {:>11} {:>11} {:>11}".format(*COLUMNS)]
    for r in rows:
        lines.append(
            f"{r.size_bytes:>12} {r.count:>11} {r.dtype:>9} {r.time_us:>11.2f} {r.device_us:>11.2f} "
            f"{r.algbw_GBps:>11.3f} {r.busbw_GBps:>11.3f}"
        )
    return lines


def sweep_sizes(sizes: list[int], dtype, device, iters: int, warmup: int, world: int, on_size=None) -> tuple[list[SizeResult], Fit]:
    """Time every size and fit the two terms to the results."""
    results = []
    for size in sizes:
        results.append(time_allreduce(size, dtype, device, iters, warmup, world))
        if on_size is not None:
            on_size(results[-1])
    fit = fit_latency_bandwidth([r.size_bytes for r in results], [r.time_us for r in results])
    return results, fit

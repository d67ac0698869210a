"""Which GEMM runs a projection of many rows (a prefill, a packed pass): torch's own in the
weight's dtype, or the weight widened to fp32 a block of rows at a time into torch's fp32 GEMM.

torch's bf16/fp16 GEMM is fast where the CPU multiplies bf16 itself (AVX-512 BF16, AMX); where it
does not (an AVX2 CPU), the same call can run several times slower than the fp32 GEMM on the same
cores, and the fp32 GEMM on a widened copy is the faster way to the same fp32 sums. Which holds is
measured once per machine on a probe cut from the model's own weight, cached beside the one-row
choices, printed by rank 0, written to --json; POCKETLLM_GEMM forces one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops import choice_cache
from pocketllm.ops.gemv.kernels import Candidate, Kernel

ENV_GEMM = "POCKETLLM_GEMM"
CACHE_FILE = "gemm.json"
# The probe: this many rows of x against up to PROBE_OUT rows of a weight, PASSES passes each.
PROBE_ROWS = 256
PROBE_OUT = 1024
PASSES = 4
# Weight rows widened at a time: beyond a few hundred the fp32 GEMM gains nothing, and the block's
# fp32 copy stays small.
BLOCK_ROWS = 256
# The widened GEMM allocates a block of fp32 per call: it must win by more than this to be chosen.
WASH = 0.05

def gemm_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The plain form every kernel must equal (up to fp32 summation order): fp32 products and
    sums, rounded once to out's dtype."""
    out.copy_(x.float() @ w.float().t())


def _mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x, w.t(), out=out)


def _mm_f32(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    xf = x.float()
    for o0 in range(0, w.shape[0], BLOCK_ROWS):
        o1 = min(o0 + BLOCK_ROWS, w.shape[0])
        out[:, o0:o1] = xf @ w[o0:o1].float().t()


CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("mm", _mm, "torch.mm in the weight's dtype"),
        Candidate("mm-f32", _mm_f32, "the weight widened to fp32 a block of rows at a time, torch's fp32 GEMM"),
    )
}
DEFAULT = "mm"


def forced_kernel(env=os.environ) -> str | None:
    """POCKETLLM_GEMM, checked: None for auto (unset, empty or "auto")."""
    value = env.get(ENV_GEMM, "").strip()
    if value in ("", "auto"):
        return None
    if value not in CANDIDATES:
        raise UsageError(f"{ENV_GEMM}={value!r} is not a many-row kernel: use auto, {', '.join(CANDIDATES)}")
    return value


@dataclass
class GemmChoice:
    """The many-row kernel for weights of one dtype, and how it was decided."""

    how: str  # "measured", "cached", "forced" or "default"
    kernel: str = DEFAULT
    # Seconds of each candidate on the probe (its fastest pass), from the measurement that made
    # this choice.
    seconds: dict[str, float] = field(default_factory=dict)
    probe: str = ""

    def describe(self) -> str:
        timed = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in self.seconds.items())
        return f"many-row GEMM ({self.how}): {self.kernel}" + (f" ({timed} on {self.probe})" if timed else "")

    def to_json(self) -> dict:
        return {"how": self.how, "kernel": self.kernel, "seconds": self.seconds, "probe": self.probe}


def choose(weights: list[torch.Tensor], env=os.environ) -> GemmChoice:
    """The many-row kernel for the model whose projection weights are `weights`."""
    forced = forced_kernel(env)
    if forced is not None:
        return GemmChoice("forced", forced)
    if not weights or weights[0].device.type != "cpu" or weights[0].dtype not in (torch.bfloat16, torch.float16):
        # fp32 weights have nothing to widen; a device's GEMM is its own library's.
        return GemmChoice("default")
    w = max(weights, key=lambda t: t.shape[1])
    probe = w[:PROBE_OUT]
    label = f"{PROBE_ROWS}x{probe.shape[1]} @ {probe.shape[1]}x{probe.shape[0]}"
    key = "|".join([compiled.cpu_model(), f"torch {torch.__version__}", str(w.dtype).removeprefix("torch."), f"{torch.get_num_threads()} threads", label])
    cached = choice_cache.read(CACHE_FILE).get(key)
    if isinstance(cached, dict) and set(cached.get("seconds", {})) == set(CANDIDATES):
        return GemmChoice("cached", pick(cached["seconds"]), cached["seconds"], label)
    seconds = measure(probe, PROBE_ROWS)
    choice_cache.write(CACHE_FILE, {key: {"seconds": seconds}})
    return GemmChoice("measured", pick(seconds), seconds, label)


def pick(seconds: dict[str, float]) -> str:
    """torch's own GEMM unless the widened one is more than WASH faster."""
    return "mm-f32" if seconds["mm-f32"] * (1 + WASH) < seconds["mm"] else "mm"


def measure(w: torch.Tensor, rows: int, passes: int = PASSES) -> dict[str, float]:
    """Seconds of each candidate on x [rows, in] @ w^T, its fastest of `passes`, the candidates'
    order reversed every other pass (after one untimed call each)."""
    x = torch.randn(rows, w.shape[1], dtype=w.dtype)
    out = torch.empty(rows, w.shape[0], dtype=w.dtype)
    names = list(CANDIDATES)
    for n in names:
        CANDIDATES[n].run(x, w, out)
    best = dict.fromkeys(names, float("inf"))
    for p in range(passes):
        for n in names if p % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            CANDIDATES[n].run(x, w, out)
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


# dtype -> the kernel installed for weights of that dtype; any other runs torch.mm.
_installed: dict[torch.dtype, Kernel] = {}


def install(choice: GemmChoice, dtype: torch.dtype) -> None:
    """Make the chosen kernel the one every many-row projection of `dtype` weights runs in this
    process."""
    _installed[dtype] = CANDIDATES[choice.kernel].run


def gemm_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, O] = x [T, I] @ w [O, I]^T by the kernel installed for w's dtype."""
    _installed.get(w.dtype, _mm)(x, w, out)

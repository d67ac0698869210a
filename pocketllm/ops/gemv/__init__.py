"""The one-row (decode) projection: candidate kernels, the measured choice per weight shape, and
the dispatch every single-row GEMV in the engine goes through."""

from pocketllm.ops.gemv.choice import ENV_GEMV, GemvChoice, check_forced, choose, forced_kernel
from pocketllm.ops.gemv.dispatch import gemv_row, install, installed
from pocketllm.ops.gemv.kernels import CANDIDATES, gemv_reference

__all__ = [
    "CANDIDATES",
    "ENV_GEMV",
    "GemvChoice",
    "check_forced",
    "choose",
    "forced_kernel",
    "gemv_reference",
    "gemv_row",
    "install",
    "installed",
]

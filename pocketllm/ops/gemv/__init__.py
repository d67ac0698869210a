"""The decode projections: candidate kernels for one row and for a few rows, the measured choice
per weight shape (and row count), and the dispatch every such GEMV in the engine goes through."""

from pocketllm.ops.gemv.choice import ENV_FEW_ROWS, ENV_GEMV, GemvChoice, check_forced, choose, forced_kernel
from pocketllm.ops.gemv.dispatch import few_rows_kernel, gemv_row, install, installed
from pocketllm.ops.gemv.kernels import CANDIDATES, FEW_ROW_CANDIDATES, gemv_reference, rows_reference

__all__ = [
    "CANDIDATES",
    "ENV_FEW_ROWS",
    "ENV_GEMV",
    "FEW_ROW_CANDIDATES",
    "GemvChoice",
    "check_forced",
    "choose",
    "few_rows_kernel",
    "forced_kernel",
    "gemv_reference",
    "gemv_row",
    "install",
    "installed",
    "rows_reference",
]

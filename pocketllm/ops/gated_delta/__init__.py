"""The gated delta rule: the torch decode step and per-token prefill, a chunked matmul form for
prefill, and the seam that picks a device kernel. The plain references the tests hold them to are
in naive.py, which nothing here imports."""

from pocketllm.ops.gated_delta.backends import GdnKernel, GdnKernelError, KernelChoice, plan_gdn_kernel, select_gdn_kernel
from pocketllm.ops.gated_delta.chunked import gated_delta_rule_chunked
from pocketllm.ops.gated_delta.recurrent import gated_delta_rule_recurrent, gated_delta_step_torch_

__all__ = [
    "GdnKernel",
    "GdnKernelError",
    "KernelChoice",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_step_torch_",
    "plan_gdn_kernel",
    "select_gdn_kernel",
]

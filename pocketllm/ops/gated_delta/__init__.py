"""The gated delta rule: a per-token reference and decode step, a chunked matmul form for
prefill, and the seam that picks a device kernel."""

from pocketllm.ops.gated_delta.backends import GdnKernel, GdnKernelError, KernelChoice, plan_gdn_kernel, select_gdn_kernel
from pocketllm.ops.gated_delta.chunked import gated_delta_rule_chunked
from pocketllm.ops.gated_delta.naive import gated_delta_rule_recurrent, gated_delta_step_

__all__ = [
    "GdnKernel",
    "GdnKernelError",
    "KernelChoice",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_step_",
    "plan_gdn_kernel",
    "select_gdn_kernel",
]

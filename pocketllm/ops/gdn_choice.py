"""Which gated-delta-rule kernel a run asks for, from (device, dtype, POCKETLLM_GDN_KERNEL) and what
is installed, no device touched (pocketllm/ops/gated_delta/backends.py builds and probes it on
each rank). Torch-free: the launcher plans it before it starts a rank; a dtype is a torch dtype
or its name."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from pocketllm.errors import UsageError
from pocketllm.switches import env_setting

# Also read as the seed's QWEN_GDN_KERNEL (pocketllm.switches.ALIASES).
ENV = "POCKETLLM_GDN_KERNEL"
CHOICES = ("chunk", "recurrent", "fla", "npu")
# What fla's kernels take as q, k, v: fla 0.6.0 runs fp32 inputs, but its chunked solve multiplies
# in TF32 where the GPU has it (fla/ops/gated_delta_rule/chunk_fwd.py), which is not the fp32 the
# oracle runs at; bf16 and fp16 are what its kernels are tuned for.
FLA_DTYPES = ("bfloat16", "float16")
# The CANN op runs bfloat16 only.
NPU_DTYPES = ("bfloat16",)


class GdnKernelError(UsageError):
    """POCKETLLM_GDN_KERNEL (or QWEN_GDN_KERNEL) names an unknown kernel, or one this machine cannot run."""


@dataclass(frozen=True)
class KernelChoice:
    name: str
    reason: str


def fla_importable() -> bool:
    return importlib.util.find_spec("fla") is not None


def npu_op_present() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu

    return hasattr(torch_npu, "npu_chunk_gated_delta_rule")


def dtype_name(dtype) -> str:
    """A torch dtype's name (float32, bfloat16, ...); a name stays itself."""
    return str(dtype).removeprefix("torch.")


def choose_gdn_kernel(device_type: str, dtype, forced: str, have_fla: bool, have_npu_op: bool, source: str = ENV) -> KernelChoice:
    """The kernel for a run, from what it asks (`forced`, read from the variable `source`) and
    what is installed; no device is touched."""
    forced = forced.strip().lower()
    dname = dtype_name(dtype)
    if not forced:
        if device_type == "cuda" and have_fla:
            if dname in FLA_DTYPES:
                return KernelChoice("fla", f"fla on cuda, {dname}")
            return KernelChoice("chunk", f"torch chunked kernel: fla would run {dname} matmuls as TF32")
        if device_type == "npu" and have_npu_op:
            if dname in NPU_DTYPES:
                return KernelChoice("npu", "torch_npu.npu_chunk_gated_delta_rule, bfloat16")
            return KernelChoice("chunk", f"torch chunked kernel: the CANN op is bfloat16-only, not {dname}")
        if device_type == "cuda" and dname in FLA_DTYPES:
            # Said where a user reads it: without fla a device's prefill runs the torch form.
            return KernelChoice("chunk", "torch chunked kernel on cuda: fla is not installed (pip install -e '.[cuda]')")
        return KernelChoice("chunk", f"torch chunked kernel on {device_type}")
    if forced not in CHOICES:
        raise GdnKernelError(f"{source}={forced!r} is not a GDN kernel; valid: {', '.join(CHOICES)}")
    if forced in ("chunk", "recurrent"):
        return KernelChoice(forced, f"forced by {source}")
    if forced == "fla":
        if device_type not in ("cuda", "npu"):
            raise GdnKernelError(f"{source}=fla needs --device cuda (or npu); this run is on {device_type}: use chunk or recurrent")
        if not have_fla:
            raise GdnKernelError(f"{source}=fla: fla is not importable (pip install -e '.[cuda]'); use chunk or recurrent")
        if dname not in FLA_DTYPES:
            raise GdnKernelError(f"{source}=fla runs bfloat16 or float16, not --dtype {dname} (fla would multiply it as TF32): use chunk")
        return KernelChoice("fla", f"forced by {source}")
    if device_type != "npu" or not have_npu_op:
        where = f"this run is on {device_type}" if device_type != "npu" else "this torch_npu lacks it"
        raise GdnKernelError(f"{source}=npu needs --device npu with torch_npu.npu_chunk_gated_delta_rule ({where}): use chunk or recurrent")
    if dname not in NPU_DTYPES:
        raise GdnKernelError(f"{source}=npu runs bfloat16 only (the CANN op), not --dtype {dname}: use chunk")
    return KernelChoice("npu", f"forced by {source}")


def probe_note(device_type: str, dtype, env=os.environ) -> str | None:
    """What rank 0 says before it builds the model where the planned GDN kernel is fla: its probe,
    at the layers' heads, is fla's first call there, which on a machine's first start compiles and
    tunes its kernels (a minute or two with nothing else to show) before the load bar starts."""
    if device_type == "cpu" or plan_gdn_kernel(device_type, dtype, env).name != "fla":
        return None
    return "gdn kernel: probing fla at the layers' heads (a machine's first start compiles and tunes its kernels first: a minute or two)"


def plan_gdn_kernel(device_type: str, dtype, env=os.environ) -> KernelChoice:
    """choose_gdn_kernel with this machine's environment and libraries."""
    source, forced = env_setting(env, ENV)
    have_fla = fla_importable()
    have_npu = device_type == "npu" and npu_op_present()
    return choose_gdn_kernel(device_type, dtype, forced, have_fla, have_npu, source)

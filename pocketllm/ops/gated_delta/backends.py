"""Which gated-delta-rule kernel runs on a device: the one seam where device kernels plug in.

Order when nothing is forced: on cuda, flash-linear-attention when importable; on npu, torch_npu's
npu_chunk_gated_delta_rule when present; otherwise the torch chunked kernel, which works
everywhere. QWEN_GDN_KERNEL=chunk|recurrent|fla|npu forces one ('recurrent' runs the per-token
loop for prefill too: the seed's ablation). Decode never takes a chunked path.

The fla and npu adapters are written from those libraries' documented signatures and have not
been run here (no CUDA or Ascend device in development): treat them as unverified.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from pocketllm.ops.gated_delta.chunked import gated_delta_rule_chunked
from pocketllm.ops.gated_delta.naive import expand_to_value_heads, gated_delta_rule_recurrent, gated_delta_step_

ENV = "QWEN_GDN_KERNEL"
CHOICES = ("chunk", "recurrent", "fla", "npu")

log = logging.getLogger("pocketllm")
_logged: set[tuple[str, str]] = set()


class GdnKernelError(ValueError):
    """QWEN_GDN_KERNEL names an unknown kernel, or one this machine cannot run."""


@dataclass(frozen=True)
class GdnKernel:
    """prefill(q, k, v, g, beta, initial_state) -> (out [T, Hv, Dv], final_state [Hv, Dk, Dv] fp32);
    decode_step_(q, k, v, g, beta, state) -> out [1, Hv, Dv] (fp32 or v's dtype; the layer rounds
    it to its own), advancing `state` in place."""

    name: str
    reason: str
    prefill: Callable
    decode_step_: Callable


def _fla_available(device_type: str) -> bool:
    return device_type == "cuda" and importlib.util.find_spec("fla") is not None


def _npu_available(device_type: str) -> bool:
    if device_type != "npu" or importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu

    return hasattr(torch_npu, "npu_chunk_gated_delta_rule")


def _fla_prefill(q, k, v, g, beta, initial_state=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # fla takes [B, T, H, D] with q and k at value heads (older releases have no grouped
    # heads) and scales q itself: ours is already scaled, hence scale=1.
    Hv = v.shape[1]
    q_v, k_v = (expand_to_value_heads(x, Hv).to(v.dtype) for x in (q, k))
    state = None if initial_state is None else initial_state[None].float()
    out, final = chunk_gated_delta_rule(
        q_v[None], k_v[None], v[None], g[None].float(), beta[None].to(v.dtype),
        scale=1.0, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False,
    )
    return out[0].to(v.dtype), final[0].float()


def _fla_decode_step_(q, k, v, g, beta, state):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    Hv = v.shape[1]
    q_v, k_v = (expand_to_value_heads(x, Hv).to(v.dtype) for x in (q, k))
    out, final = fused_recurrent_gated_delta_rule(
        q_v[None], k_v[None], v[None], g[None].float(), beta[None].to(v.dtype),
        scale=1.0, initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=False,
    )
    # fla returns the new state rather than updating it; the caller owns `state`.
    state.copy_(final[0])
    return out[0]


def _npu_prefill(q, k, v, g, beta, initial_state=None):
    import torch_npu

    # The CANN op takes packed [T, H, D] in bf16/fp16 (key heads for q and k), g in fp32, and
    # its state value-major, [B, Hv, Dv, Dk].
    T, Hv, Dv = v.shape
    Dk = k.shape[-1]
    low = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if initial_state is None:
        initial_state = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    out, final = torch_npu.npu_chunk_gated_delta_rule(
        q.to(low), k.to(low), v.to(low),
        beta=beta.to(low),
        initial_state=initial_state.transpose(-1, -2)[None].to(low).contiguous(),
        actual_seq_lengths=torch.tensor([T], dtype=torch.int32, device=v.device),
        scale=1.0,
        g=g.float(),
    )
    return out.to(v.dtype), final[0].transpose(-1, -2).float().contiguous()


def _build(name: str, reason: str) -> GdnKernel:
    if name == "fla":
        return GdnKernel(name, reason, _fla_prefill, _fla_decode_step_)
    if name == "npu":
        return GdnKernel(name, reason, _npu_prefill, gated_delta_step_)
    if name == "recurrent":
        return GdnKernel(name, reason, gated_delta_rule_recurrent, gated_delta_step_)
    return GdnKernel(name, reason, gated_delta_rule_chunked, gated_delta_step_)


def select_gdn_kernel(device_type: str) -> GdnKernel:
    """The kernel for `device_type` ('cpu', 'cuda', 'npu', ...), honouring QWEN_GDN_KERNEL."""
    forced = os.environ.get(ENV, "").strip().lower()
    available = ["chunk", "recurrent"]
    if _fla_available(device_type):
        available.append("fla")
    if _npu_available(device_type):
        available.append("npu")
    if forced:
        if forced not in CHOICES:
            raise GdnKernelError(f"{ENV}={forced!r} is not a GDN kernel; valid: {', '.join(CHOICES)}")
        if forced not in available:
            raise GdnKernelError(
                f"{ENV}={forced} is not available on device {device_type!r}; available: {', '.join(available)}"
            )
        kernel = _build(forced, f"forced by {ENV}")
    elif "fla" in available:
        kernel = _build("fla", "cuda with flash-linear-attention")
    elif "npu" in available:
        kernel = _build("npu", "npu with torch_npu.npu_chunk_gated_delta_rule")
    else:
        kernel = _build("chunk", f"torch chunked kernel on {device_type}")
    if (kernel.name, kernel.reason) not in _logged:
        _logged.add((kernel.name, kernel.reason))
        log.info("gdn kernel: %s (%s)", kernel.name, kernel.reason)
    return kernel

"""The decode step's work between its GEMVs: a norm with its residual add, SiLU-and-multiply, the
Gated DeltaNet block from conv to gated norm, and gated attention from q/k norm to the output
gate, each one call per row. Compiled (decode_bf16.c) for bf16 on a CPU, where a decode row's dozens of small torch ops cost more than their arithmetic;
the torch forms (ops/rowwise.py) everywhere else. `POCKETLLM_FUSED_DECODE=0` keeps the torch forms.
Both are held to the plain references in reference.py, which only the tests import."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from pocketllm.ops.device import DeviceOps, device_ops
from pocketllm.ops.device import TORCH_OPS as DEVICE_TORCH_OPS
from pocketllm.ops.fused import kernels
from pocketllm.ops.rowwise import add_rms_norm_torch, silu_mul_torch
from pocketllm.switches import env_switch

ENV_FUSED = "POCKETLLM_FUSED_DECODE"


@dataclass(frozen=True)
class DecodeOps:
    add_rms_norm: object
    silu_mul: object
    gdn_decode: object | None  # None: the layer runs its torch path
    gdn_decode_rows: object | None  # several sequences' decode rows in one call (None: one by one)
    attention_decode: object | None
    compiled: bool
    note: str
    # What a device's pass shape runs over all of a pass's rows (ops/device: Triton kernels on
    # CUDA), where the fields above serve a CPU's one-row and rows forms.
    device: DeviceOps = DEVICE_TORCH_OPS

    def describe(self) -> str:
        return f"decode ops: {'compiled' if self.compiled else 'torch'}" + (f" ({self.note})" if self.note else "")


TORCH_OPS = DecodeOps(add_rms_norm_torch, silu_mul_torch, None, None, None, False, "")


def decode_ops(dtype: torch.dtype, device: torch.device, env=os.environ) -> DecodeOps:
    """The compiled decode ops where they apply and are wanted, else the torch forms."""
    if not env_switch(env, ENV_FUSED, default=True):
        # The device's pass shape runs the torch forms too (no Triton ops on a GPU), and rank 0's
        # "device ops" line says why.
        off = f"{ENV_FUSED}=0"
        return replace(TORCH_OPS, note=off, device=replace(DEVICE_TORCH_OPS, note=off))
    if device.type != "cpu":
        return replace(TORCH_OPS, device=device_ops(device))
    if dtype != torch.bfloat16:
        return TORCH_OPS
    lib, why = kernels.library()
    if lib is None:
        return replace(TORCH_OPS, note=why)
    return DecodeOps(kernels.add_rms_norm, kernels.silu_mul, kernels.gdn_decode, kernels.gdn_decode_rows, kernels.attention_decode, True, "")


__all__ = ["ENV_FUSED", "TORCH_OPS", "DecodeOps", "decode_ops", "kernels"]

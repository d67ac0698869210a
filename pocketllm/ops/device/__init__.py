"""The work between a prefill pass's GEMMs on a device, as few kernels per layer as the work
allows: the residual add with the RMSNorm, the GDN's gated RMSNorm, its q/k l2 norm and gates,
SiLU-and-multiply, the causal conv, rope and the KV write, each one Triton kernel over all of a
pass's rows (kernels/) where the torch form is several ops, each a pass over every row; and for a
decode step of B sequences, the paged attention read, one kernel over its rows that reads only the
positions each row holds where the torch form gathers every block of the tables, the KV write of
its rows, and the conv, one kernel that advances each sequence's window where it lies in the
layer's stacked state. Each has
its torch form beside it with the same signature (torch_forms.py); both are torch custom ops
(library.py), the kernel on CUDA and the torch form elsewhere.

device_ops(device) says which a device runs: the custom ops on CUDA where Triton imports, else the
torch forms, with the reason. A CPU never runs these: its own forms (row blocks, the compiled C
rows forms) are chosen in ops/fused and layers/row_forms.py."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace

import torch

from pocketllm.ops.device import library, probe, torch_forms


@dataclass(frozen=True)
class DeviceOps:
    add_rms_norm: object  # (h, x | None, scale, eps) -> (h + x, norm)
    rms_norm_gated: object  # (x, z, weight, eps) -> out
    qk_l2_norm: object  # (qk, heads_q, q_scale, eps) -> (q, k) fp32
    gdn_gates: object  # (a, b, neg_a, dt_bias) -> (g, beta) fp32
    silu_mul: object  # (gate, up) -> out
    causal_conv1d_prefill_: object  # (x, taps, state) -> out, state advanced
    causal_conv1d_rows_indexed_: object  # (x, taps, states, slots) -> out, the slots' windows advanced
    apply_rotary: object  # (x, cos, sin) -> out
    write_kv: object  # (k_pool, v_pool, table, start, k, v) -> None
    write_kv_rows: object  # (k_pool, v_pool, tables, pos, k, v) -> None: a decode step's rows
    decode_attention_rows: object  # (q, k_pool, v_pool, tables, pos, scale) -> out
    kernels: bool  # True: the custom ops, Triton kernels on CUDA
    note: str

    def describe(self) -> str:
        return f"device ops: {'triton' if self.kernels else 'torch'}" + (f" ({self.note})" if self.note else "")


TORCH_OPS = DeviceOps(
    torch_forms.add_rms_norm_torch, torch_forms.rms_norm_gated, torch_forms.qk_l2_norm_torch, torch_forms.gdn_gates_torch,
    torch_forms.silu_mul_torch, torch_forms.causal_conv1d_prefill_, torch_forms.causal_conv1d_rows_indexed_,
    torch_forms.apply_rotary_torch, torch_forms.write_kv_torch, torch_forms.write_kv_rows_torch, torch_forms.decode_attention_rows_torch,
    False, "",
)

# The custom ops: one op each to torch, a Triton kernel on CUDA, the torch form on other devices
# (so a test on CPU counts the ops a device pass would issue with these).
CUSTOM_OPS = DeviceOps(
    library.add_rms_norm, library.rms_norm_gated_op, library.qk_l2_norm_op, library.gdn_gates_op, library.silu_mul_op,
    library.causal_conv1d_prefill_op, library.causal_conv1d_rows_indexed_op, library.apply_rotary_op, library.write_kv_op,
    library.write_kv_rows_op, library.decode_attention_rows_op, True, "",
)


def triton_missing() -> str | None:
    """Why Triton cannot run here (its import's error), or None."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # any failure to import means the kernels cannot run
        return f"triton does not import: {type(exc).__name__}: {exc}".rstrip(": ")
    return None


def device_ops(device: torch.device) -> DeviceOps:
    """The custom ops (Triton kernels) on CUDA where Triton imports and every kernel passes its
    probe there (probe.py), else the torch forms, saying why."""
    device = torch.device(device)
    if device.type != "cuda":
        return TORCH_OPS if device.type == "cpu" else replace(TORCH_OPS, note=f"no Triton kernels for {device.type}")
    return _probed(device)


@functools.cache
def _probed(device: torch.device) -> DeviceOps:
    """CUSTOM_OPS where they run and agree on `device` (once per process and device), else the
    torch forms with the reason."""
    why = triton_missing()
    if why is None:
        why = probe.disagreement(CUSTOM_OPS, TORCH_OPS, device)
        why = None if why is None else f"a kernel failed its probe: {why}"
    return CUSTOM_OPS if why is None else replace(TORCH_OPS, note=why)


__all__ = ["CUSTOM_OPS", "TORCH_OPS", "DeviceOps", "device_ops", "triton_missing"]

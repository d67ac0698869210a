"""The device prefill ops as torch custom ops (namespace pocketllm): on CUDA each launches its
Triton kernel (kernels/), on any other device it runs the torch form (torch_forms.py). To torch
each is one opaque op with a fake (shape-only) form, so torch.compile and a CUDA graph capture
trace it without entering it, and a dispatch-mode counter sees one op where the torch form issues
several (pocketllm.profiling.op_count).

The kernel modules are imported on the first CUDA call, so registering the ops needs no Triton.
Outputs never alias inputs (a custom op's rule): add_rms_norm without x is its own op, rms_norm."""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from pocketllm.ops.device import torch_forms


def _kernel(module: str, name: str):
    """The launcher `name` of kernels/MODULE.py."""
    return getattr(importlib.import_module(f"pocketllm.ops.device.kernels.{module}"), name)


def _new(t: Tensor, dtype: torch.dtype | None = None, shape=None) -> Tensor:
    """A contiguous tensor like t (what the kernels return), for the fake forms."""
    return t.new_empty(t.shape if shape is None else shape, dtype=dtype or t.dtype)


@torch.library.custom_op("pocketllm::add_rms_norm", mutates_args=())
def add_rms_norm_op(h: Tensor, x: Tensor, scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch_forms.add_rms_norm_torch(h, x, scale, eps)


@add_rms_norm_op.register_kernel("cuda")
def _(h, x, scale, eps):
    return _kernel("add_rms_norm", "add_rms_norm")(h, x, scale, eps)


@add_rms_norm_op.register_fake
def _(h, x, scale, eps):
    return _new(h), _new(h)


@torch.library.custom_op("pocketllm::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    return torch_forms.rms_norm_scaled(x, scale, eps)


@rms_norm_op.register_kernel("cuda")
def _(x, scale, eps):
    return _kernel("add_rms_norm", "add_rms_norm")(x, None, scale, eps)[1]


@rms_norm_op.register_fake
def _(x, scale, eps):
    return _new(x)


@torch.library.custom_op("pocketllm::rms_norm_gated", mutates_args=())
def rms_norm_gated_op(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch_forms.rms_norm_gated(x, z, weight, eps)


@rms_norm_gated_op.register_kernel("cuda")
def _(x, z, weight, eps):
    return _kernel("gated_norm", "rms_norm_gated")(x, z, weight, eps)


@rms_norm_gated_op.register_fake
def _(x, z, weight, eps):
    return _new(x)


@torch.library.custom_op("pocketllm::qk_l2_norm", mutates_args=())
def qk_l2_norm_op(qk: Tensor, heads_q: int, q_scale: float, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    q, k = torch_forms.qk_l2_norm_torch(qk, heads_q, q_scale, eps)
    return q, k.contiguous()


@qk_l2_norm_op.register_kernel("cuda")
def _(qk, heads_q, q_scale, eps=1e-6):
    return _kernel("qk_l2_norm", "qk_l2_norm")(qk, heads_q, q_scale, eps)


@qk_l2_norm_op.register_fake
def _(qk, heads_q, q_scale, eps=1e-6):
    t, heads, n = qk.shape
    return _new(qk, torch.float32, (t, heads_q, n)), _new(qk, torch.float32, (t, heads - heads_q, n))


@torch.library.custom_op("pocketllm::gdn_gates", mutates_args=())
def gdn_gates_op(a: Tensor, b: Tensor, neg_a: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    return torch_forms.gdn_gates_torch(a, b, neg_a, dt_bias)


@gdn_gates_op.register_kernel("cuda")
def _(a, b, neg_a, dt_bias):
    return _kernel("gdn_gates", "gdn_gates")(a, b, neg_a, dt_bias)


@gdn_gates_op.register_fake
def _(a, b, neg_a, dt_bias):
    return _new(a, torch.float32), _new(a, torch.float32)


@torch.library.custom_op("pocketllm::silu_mul", mutates_args=())
def silu_mul_op(gate: Tensor, up: Tensor) -> Tensor:
    return torch_forms.silu_mul_torch(gate, up)


@silu_mul_op.register_kernel("cuda")
def _(gate, up):
    return _kernel("silu_mul", "silu_mul")(gate, up)


@silu_mul_op.register_fake
def _(gate, up):
    return _new(gate)


@torch.library.custom_op("pocketllm::causal_conv1d_prefill_", mutates_args=("state",))
def causal_conv1d_prefill_op(x: Tensor, taps: Tensor, state: Tensor) -> Tensor:
    return torch_forms.causal_conv1d_prefill_(x, taps, state)


@causal_conv1d_prefill_op.register_kernel("cuda")
def _(x, taps, state):
    return _kernel("causal_conv", "causal_conv1d_prefill_")(x, taps, state)


@causal_conv1d_prefill_op.register_fake
def _(x, taps, state):
    return _new(x)


@torch.library.custom_op("pocketllm::causal_conv1d_rows_indexed_", mutates_args=("states",))
def causal_conv1d_rows_indexed_op(x: Tensor, taps: Tensor, states: Tensor, slots: Tensor) -> Tensor:
    return torch_forms.causal_conv1d_rows_indexed_(x, taps, states, slots)


@causal_conv1d_rows_indexed_op.register_kernel("cuda")
def _(x, taps, states, slots):
    return _kernel("causal_conv_rows", "causal_conv1d_rows_indexed_")(x, taps, states, slots)


@causal_conv1d_rows_indexed_op.register_fake
def _(x, taps, states, slots):
    return _new(x)


@torch.library.custom_op("pocketllm::apply_rotary", mutates_args=())
def apply_rotary_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch_forms.apply_rotary_torch(x, cos, sin)


@apply_rotary_op.register_kernel("cuda")
def _(x, cos, sin):
    return _kernel("rope", "apply_rotary")(x, cos, sin)


@apply_rotary_op.register_fake
def _(x, cos, sin):
    return _new(x)


@torch.library.custom_op("pocketllm::write_kv", mutates_args=("k_pool", "v_pool"))
def write_kv_op(k_pool: Tensor, v_pool: Tensor, table: Tensor, start: int, k: Tensor, v: Tensor) -> None:
    torch_forms.write_kv_torch(k_pool, v_pool, table, start, k, v)


@write_kv_op.register_kernel("cuda")
def _(k_pool, v_pool, table, start, k, v):
    _kernel("kv_write", "write_kv")(k_pool, v_pool, table, start, k, v)


@write_kv_op.register_fake
def _(k_pool, v_pool, table, start, k, v):
    return None


@torch.library.custom_op("pocketllm::write_kv_rows", mutates_args=("k_pool", "v_pool"))
def write_kv_rows_op(k_pool: Tensor, v_pool: Tensor, tables: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    torch_forms.write_kv_rows_torch(k_pool, v_pool, tables, pos, k, v)


@write_kv_rows_op.register_kernel("cuda")
def _(k_pool, v_pool, tables, pos, k, v):
    _kernel("kv_write", "write_kv_rows")(k_pool, v_pool, tables, pos, k, v)


@write_kv_rows_op.register_fake
def _(k_pool, v_pool, tables, pos, k, v):
    return None


@torch.library.custom_op("pocketllm::decode_attention_rows", mutates_args=())
def decode_attention_rows_op(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, pos: Tensor, scale: float) -> Tensor:
    return torch_forms.decode_attention_rows_torch(q, k_pool, v_pool, tables, pos, scale)


@decode_attention_rows_op.register_kernel("cuda")
def _(q, k_pool, v_pool, tables, pos, scale):
    return _kernel("decode_attention", "decode_attention_rows")(q, k_pool, v_pool, tables, pos, scale)


@decode_attention_rows_op.register_fake
def _(q, k_pool, v_pool, tables, pos, scale):
    return _new(q)


def add_rms_norm(h: Tensor, x: Tensor | None, scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """add_rms_norm_torch's signature over the two ops: x None is the norm alone, h returned."""
    if x is None:
        return h, rms_norm_op(h, scale, eps)
    return add_rms_norm_op(h, x, scale, eps)

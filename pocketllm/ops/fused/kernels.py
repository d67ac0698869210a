"""The compiled forms of the decode step's work between GEMVs (decode_bf16.c), for one bf16 row on
a CPU; each has the signature of its torch form in reference.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pocketllm import compiled

_SOURCE = Path(__file__).with_name("decode_bf16.c")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm_bf16": [_P, _P, _P, _F, _I, _P, _P],
    "silu_mul_bf16": [_P, _P, _P, _I],
    "gdn_decode_bf16": [_P, _P, _P, _P, _P, _P, _F, _P, _P, _I, _I, _I, _I, _I, _P],
    "attention_decode_bf16": [_P, _P, _P, _F, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P],
}
_lib = None


def library() -> tuple[ctypes.CDLL | None, str]:
    global _lib
    lib, why = compiled.load(_SOURCE)
    if lib is not None and _lib is None:
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
        _lib = lib
    return lib, why


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h_out = torch.empty_like(h) if x is not None else h
    y = torch.empty_like(h)
    _lib.add_rms_norm_bf16(h.data_ptr(), _ptr(x), scale.data_ptr(), eps, h.shape[-1], _ptr(h_out if x is not None else None), y.data_ptr())
    return h_out, y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    _lib.silu_mul_bf16(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def gdn_decode(proj, taps, conv_state, neg_a, dt_bias, norm_w, eps: float, state, hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    conv = 2 * hk * dk + hv * dv
    out = torch.empty(1, hv * dv, dtype=proj.dtype)
    work = torch.empty(conv + 2 * hv + hv * dv, dtype=torch.float32)
    k = taps.shape[0]
    # Held in a name for the call: a temporary's memory could go back to the allocator before it.
    proj = proj.contiguous()
    _lib.gdn_decode_bf16(
        proj.data_ptr(), taps.data_ptr(), conv_state.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
        norm_w.data_ptr(), eps, state.data_ptr(), out.data_ptr(), hk, hv, dk, dv, k, work.data_ptr(),
    )
    return out


def attention_decode(qkv, q_scale, k_scale, eps: float, cos, sin, k_pool, v_pool, table, pos: int, heads: int, kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """k_pool, v_pool [blocks, kv_heads, block_size, head_dim] (layers/cache.py); table: the
    sequence's block ids, int32, covering position pos."""
    half = cos.shape[-1]
    out = torch.empty(1, heads * head_dim, dtype=qkv.dtype)
    work = torch.empty(heads * head_dim + kv_heads * head_dim + heads * (pos + 1), dtype=torch.float32)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    _lib.attention_decode_bf16(
        qkv.data_ptr(), q_scale.data_ptr(), k_scale.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(),
        v_pool.data_ptr(), table.data_ptr(), k_pool.shape[2], pos, heads, kv_heads, head_dim, half, scale, out.data_ptr(), work.data_ptr(),
    )
    return out

"""The compiled forms of the decode step's work between GEMVs (decode_bf16.c), for one bf16 row on
a CPU; each has the signature of its torch form in reference.py. Each checks its arguments'
dtypes, sizes and strides before passing pointers (pocketllm.ops.native_args): a wrong one raises
a ValueError naming it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pocketllm import compiled
from pocketllm.ops.native_args import refuse

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


_BF16, _F32, _I32 = torch.bfloat16, torch.float32, torch.int32


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = h.shape[-1]
    if not (
        h.dtype is _BF16 and h.numel() == n and h.is_contiguous() and h.is_cpu and scale.dtype is _F32 and scale.numel() == n
        and scale.is_contiguous() and (x is None or (x.dtype is _BF16 and x.numel() == n and x.is_contiguous() and x.is_cpu))
    ):
        refuse("add_rms_norm_bf16", [("h", h, _BF16, n, True, None), ("x", x, _BF16, n, True, None), ("scale", scale, _F32, n, True, None)])
    h_out = torch.empty_like(h) if x is not None else h
    y = torch.empty_like(h)
    _lib.add_rms_norm_bf16(h.data_ptr(), _ptr(x), scale.data_ptr(), eps, h.shape[-1], _ptr(h_out if x is not None else None), y.data_ptr())
    return h_out, y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    if not (gate.dtype is _BF16 and up.dtype is _BF16 and up.numel() == gate.numel() and gate.is_cpu and up.is_cpu):
        refuse("silu_mul_bf16", [("gate", gate, _BF16, None, True, None), ("up", up, _BF16, gate.numel(), True, None)])
    out = torch.empty_like(gate)
    _lib.silu_mul_bf16(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def gdn_decode(proj, taps, conv_state, neg_a, dt_bias, norm_w, eps: float, state, hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    conv = 2 * hk * dk + hv * dv
    k = taps.shape[0]
    # Held in a name for the call: a temporary's memory could go back to the allocator before it.
    proj = proj.contiguous()
    specs = [
        ("proj", proj, _BF16, conv + hv * dv + 2 * hv, True, None), ("taps", taps, _F32, k * conv, True, 2),
        ("conv_state", conv_state, _BF16, (k - 1) * conv, True, None), ("neg_a", neg_a, _F32, hv, True, None),
        ("dt_bias", dt_bias, _BF16, hv, True, None), ("norm_w", norm_w, _BF16, dv, True, None), ("state", state, _F32, hv * dk * dv, True, None),
    ]
    if not all(t.dtype is dtype and t.numel() == numel and t.is_contiguous() and t.is_cpu for _, t, dtype, numel, _, _ in specs):
        refuse("gdn_decode_bf16", specs)
    out = torch.empty(1, hv * dv, dtype=proj.dtype)
    work = torch.empty(conv + 2 * hv + hv * dv, dtype=torch.float32)
    _lib.gdn_decode_bf16(
        proj.data_ptr(), taps.data_ptr(), conv_state.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
        norm_w.data_ptr(), eps, state.data_ptr(), out.data_ptr(), hk, hv, dk, dv, k, work.data_ptr(),
    )
    return out


def attention_decode(qkv, q_scale, k_scale, eps: float, cos, sin, k_pool, v_pool, table, pos: int, heads: int, kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """k_pool, v_pool [blocks, kv_heads, block_size, head_dim] (layers/cache.py); table: the
    sequence's block ids, int32, covering position pos."""
    half = cos.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    specs = [
        ("qkv", qkv, _BF16, (heads * 2 + kv_heads * 2) * head_dim, True, None), ("q_scale", q_scale, _F32, head_dim, True, None),
        ("k_scale", k_scale, _F32, head_dim, True, None), ("cos", cos, _F32, half, True, None), ("sin", sin, _F32, half, True, None),
        ("k_pool", k_pool, _BF16, None, True, 4), ("v_pool", v_pool, _BF16, None, True, 4), ("table", table, _I32, None, True, 1),
    ]
    if not (
        all(t.dtype is dtype and (numel is None or t.numel() == numel) and t.is_contiguous() and t.is_cpu for _, t, dtype, numel, _, _ in specs)
        and k_pool.dim() == 4 and k_pool.shape[1] == kv_heads and k_pool.shape[3] == head_dim and v_pool.shape == k_pool.shape
        and 0 <= pos < table.numel() * k_pool.shape[2] and 2 * half <= head_dim
    ):
        _refuse_attention(specs, k_pool, v_pool, table, kv_heads, head_dim, pos, half)
    # The blocks the kernel reads must be the pool's: a bad id would read outside it.
    used = table[: pos // k_pool.shape[2] + 1]
    if int(used.min()) < 0 or int(used.max()) >= k_pool.shape[0]:
        raise ValueError(f"attention_decode_bf16: table holds block ids outside the pool's {k_pool.shape[0]} blocks")
    out = torch.empty(1, heads * head_dim, dtype=qkv.dtype)
    work = torch.empty(heads * head_dim + kv_heads * head_dim + heads * (pos + 1), dtype=torch.float32)
    _lib.attention_decode_bf16(
        qkv.data_ptr(), q_scale.data_ptr(), k_scale.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(),
        v_pool.data_ptr(), table.data_ptr(), k_pool.shape[2], pos, heads, kv_heads, head_dim, half, scale, out.data_ptr(), work.data_ptr(),
    )
    return out


def _refuse_attention(specs, k_pool, v_pool, table, kv_heads: int, head_dim: int, pos: int, half: int) -> None:
    name = "attention_decode_bf16"
    if not all(t.dtype is dtype and (numel is None or t.numel() == numel) and t.is_contiguous() and t.is_cpu for _, t, dtype, numel, _, _ in specs):
        refuse(name, specs)
    if k_pool.dim() != 4 or v_pool.dim() != 4 or table.dim() != 1:
        refuse(name, [(n, t, d, None, True, nd) for n, t, d, _, _, nd in specs[5:]])
    for arg, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t.shape[1] != kv_heads or t.shape[3] != head_dim or t.shape != k_pool.shape:
            raise ValueError(f"{name}: {arg} has shape {tuple(t.shape)} where [blocks, {kv_heads}, block_size, {head_dim}] (as k_pool) is needed")
    if not 0 <= pos < table.numel() * k_pool.shape[2]:
        raise ValueError(f"{name}: pos {pos} is outside the {table.numel()} blocks of {k_pool.shape[2]} positions the table covers")
    raise ValueError(f"{name}: cos and sin hold {half} values, more than half of head_dim {head_dim}")


_SIGNATURES_ROWS = {
    "add_rms_norm_rows_bf16": [_P, _P, _P, _F, _I, _I, _P, _P],
    "silu_mul_rows_bf16": [_P, _P, _I, _I, _I, _P],
}


def _rows_lib():
    lib, _ = library()
    if lib is not None and lib.add_rms_norm_rows_bf16.argtypes is None:
        for name, args in _SIGNATURES_ROWS.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
    return lib


def add_rms_norm_rows(h: torch.Tensor, x: torch.Tensor | None, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm on each row of h, x [rows, n]: each row gets the bits add_rms_norm gives it
    alone (a decode step of several sequences)."""
    n = h.shape[-1]
    rows = h.numel() // max(n, 1)
    if not (
        h.dtype is _BF16 and h.dim() == 2 and h.is_contiguous() and h.is_cpu and scale.dtype is _F32 and scale.numel() == n and scale.is_contiguous()
        and (x is None or (x.dtype is _BF16 and x.shape == h.shape and x.is_contiguous() and x.is_cpu))
    ):
        refuse("add_rms_norm_rows_bf16", [("h", h, _BF16, None, True, 2), ("x", x, _BF16, h.numel(), True, None), ("scale", scale, _F32, n, True, None)])
    h_out = torch.empty_like(h) if x is not None else h
    y = torch.empty_like(h)
    _rows_lib().add_rms_norm_rows_bf16(h.data_ptr(), _ptr(x), scale.data_ptr(), eps, n, rows, _ptr(h_out if x is not None else None), y.data_ptr())
    return h_out, y


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu_mul on each row of gate, up [rows, n] (views into one tensor's rows, as the halves of
    a projection's output are): each row gets the bits silu_mul gives it alone."""
    rows, n = gate.shape[0], gate.shape[-1]
    if not (
        gate.dtype is _BF16 and up.dtype is _BF16 and gate.dim() == 2 and up.shape == gate.shape and gate.stride(1) == 1 and up.stride(1) == 1
        and gate.stride(0) == up.stride(0) and gate.stride(0) >= n and gate.is_cpu and up.is_cpu
    ):
        refuse("silu_mul_rows_bf16", [("gate", gate, _BF16, None, False, 2), ("up", up, _BF16, gate.numel(), False, 2)])
    out = torch.empty(rows, n, dtype=gate.dtype)
    _rows_lib().silu_mul_rows_bf16(gate.data_ptr(), up.data_ptr(), gate.stride(0), n, rows, out.data_ptr())
    return out

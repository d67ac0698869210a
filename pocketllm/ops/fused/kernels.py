"""The compiled forms of the decode step's work between GEMVs (decode_bf16.c, attention_bf16.c), for
one bf16 row on a CPU; each has the signature of its reference in reference.py. Each checks its arguments'
dtypes, sizes and strides before passing pointers (pocketllm.ops.native_args): a wrong one raises
a ValueError naming it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pocketllm import compiled
from pocketllm.ops.native_args import refuse

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Per source, its functions' argument types (and result type, None for void).
_SIGNATURES = {
    "decode_bf16.c": {
        "add_rms_norm_bf16": ([_P, _P, _P, _F, _I, _P, _P], None),
        "silu_mul_bf16": ([_P, _P, _P, _I], None),
        "gdn_decode_bf16": ([_P, _P, _P, _P, _P, _P, _F, _P, _P, _I, _I, _I, _I, _I, _P], None),
        "gdn_decode_rows_bf16": ([_P, _I, _I, _P, _P, _P, _P, _P, _F, _P, _P, _I, _I, _I, _I, _I, _P], None),
        "add_rms_norm_rows_bf16": ([_P, _P, _P, _F, _I, _I, _P, _P], None),
        "silu_mul_rows_bf16": ([_P, _P, _I, _I, _I, _P], None),
        "conv_silu_rows_bf16": ([_P, _I, _I, _I, _P, _I, _P, _P], None),
        "rms_norm_gated_rows_bf16": ([_P, _P, _I, _I, _P, _F, _I, _I, _P], None),
        "gdn_work_floats": ([_I, _I, _I, _I], _I),
    },
    "attention_bf16.c": {
        "attention_decode_bf16": ([_P, _P, _P, _F, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I], ctypes.c_int),
        "attention_decode_work_floats": ([_I, _I, _I, _I, _I], _I),
    },
}
# Cache positions x KV heads x head dim from which attention splits over the threads: below it
# the whole call is a few microseconds' work, less than waking the threads costs.
ATTENTION_PARALLEL_MIN = 1 << 16
_lib = None
_attn: dict[str, ctypes.CDLL] = {}
_attention_work: dict[tuple, torch.Tensor] = {}
_gdn_work: dict[int, torch.Tensor] = {}


def _load(source: str, isa: str = "native") -> tuple[ctypes.CDLL | None, str]:
    lib, why = compiled.load(Path(__file__).with_name(source), compiled.FLAGS + compiled.ISA_FLAGS[isa])
    if lib is not None:
        for name, (args, result) in _SIGNATURES[source].items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = result
    return lib, why


def library() -> tuple[ctypes.CDLL | None, str]:
    """(the decode library, "") once both sources are built, else (None, why not)."""
    global _lib
    lib, why = _load("decode_bf16.c")
    attn, attn_why = attention_library()
    if lib is None or attn is None:
        return None, why or attn_why
    _lib = lib
    return lib, ""


def attention_library(isa: str = "native") -> tuple[ctypes.CDLL | None, str]:
    """The attention kernel built for one of compiled.ISA_FLAGS' paths, or (None, why not)."""
    if isa not in _attn:
        lib, why = _load("attention_bf16.c", isa)
        if lib is None:
            return None, why
        _attn[isa] = lib
    return _attn[isa], ""


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
    # One expression of attribute reads on the hot path (six of these calls a step of the small
    # preset); the argument at fault is found only when it fails.
    if not (
        proj.dtype is _BF16 and proj.numel() == conv + hv * dv + 2 * hv and proj.is_cpu
        and taps.dtype is _F32 and taps.numel() == k * conv and taps.is_contiguous() and taps.is_cpu
        and conv_state.dtype is _BF16 and conv_state.numel() == (k - 1) * conv and conv_state.is_contiguous() and conv_state.is_cpu
        and neg_a.dtype is _F32 and neg_a.numel() == hv and neg_a.is_contiguous() and neg_a.is_cpu
        and dt_bias.dtype is _BF16 and dt_bias.numel() == hv and dt_bias.is_contiguous() and dt_bias.is_cpu
        and norm_w.dtype is _BF16 and norm_w.numel() == dv and norm_w.is_contiguous() and norm_w.is_cpu
        and state.dtype is _F32 and state.numel() == hv * dk * dv and state.is_contiguous() and state.is_cpu
    ):
        refuse("gdn_decode_bf16", [
            ("proj", proj, _BF16, conv + hv * dv + 2 * hv, True, None), ("taps", taps, _F32, k * conv, True, 2),
            ("conv_state", conv_state, _BF16, (k - 1) * conv, True, None), ("neg_a", neg_a, _F32, hv, True, None),
            ("dt_bias", dt_bias, _BF16, hv, True, None), ("norm_w", norm_w, _BF16, dv, True, None), ("state", state, _F32, hv * dk * dv, True, None),
        ])
    out = torch.empty(1, hv * dv, dtype=proj.dtype)
    work = gdn_work(hk, hv, dk, dv)
    _lib.gdn_decode_bf16(
        proj.data_ptr(), taps.data_ptr(), conv_state.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
        norm_w.data_ptr(), eps, state.data_ptr(), out.data_ptr(), hk, hv, dk, dv, k, work.data_ptr(),
    )
    return out


def gdn_decode_rows(proj, taps, conv_states, neg_a, dt_bias, norm_w, eps: float, states, hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    """gdn_decode for the decode rows of several sequences in one call: proj [B, in] (rows may be a
    view's, a stride apart), conv_states and states B tensors, each row's own (as gdn_decode takes
    them) -> [B, hv*dv]. Each row gets the bits gdn_decode gives it alone."""
    conv = 2 * hk * dk + hv * dv
    k, width = taps.shape[0], conv + hv * dv + 2 * hv
    if not (
        proj.dtype is _BF16 and proj.dim() == 2 and proj.is_cpu
        and taps.dtype is _F32 and taps.numel() == k * conv and taps.is_contiguous() and taps.is_cpu
        and neg_a.dtype is _F32 and neg_a.numel() == hv and neg_a.is_contiguous() and neg_a.is_cpu
        and dt_bias.dtype is _BF16 and dt_bias.numel() == hv and dt_bias.is_contiguous() and dt_bias.is_cpu
        and norm_w.dtype is _BF16 and norm_w.numel() == dv and norm_w.is_contiguous() and norm_w.is_cpu
    ):
        refuse("gdn_decode_rows_bf16", [
            ("proj", proj, _BF16, None, False, 2), ("taps", taps, _F32, k * conv, True, 2), ("neg_a", neg_a, _F32, hv, True, None),
            ("dt_bias", dt_bias, _BF16, hv, True, None), ("norm_w", norm_w, _BF16, dv, True, None),
        ])
    rows = proj.shape[0]
    if proj.shape[1] != width or proj.stride(1) != 1:
        raise ValueError(f"gdn_decode_rows_bf16: proj has shape {tuple(proj.shape)} and strides {proj.stride()} where rows of {width} contiguous values are needed")
    if len(conv_states) != rows or len(states) != rows:
        raise ValueError(f"gdn_decode_rows_bf16: {rows} rows of proj, {len(conv_states)} conv states and {len(states)} states")
    for i, (c, st) in enumerate(zip(conv_states, states)):
        if not (
            c.dtype is _BF16 and c.numel() == (k - 1) * conv and c.is_contiguous() and c.is_cpu
            and st.dtype is _F32 and st.numel() == hv * dk * dv and st.is_contiguous() and st.is_cpu
        ):
            refuse("gdn_decode_rows_bf16", [(f"conv_states[{i}]", c, _BF16, (k - 1) * conv, True, None), (f"states[{i}]", st, _F32, hv * dk * dv, True, None)])
    conv_ptrs = [c.data_ptr() for c in conv_states]
    state_ptrs = [st.data_ptr() for st in states]
    # The rows advance their states at once: two rows on one state would race, and each must
    # see the other's step (a sequence's rows run one after another, through gdn_decode).
    if len(set(state_ptrs)) != rows or len(set(conv_ptrs)) != rows:
        raise ValueError("gdn_decode_rows_bf16: two rows share a state; a sequence's rows run one at a time")
    out = torch.empty(rows, hv * dv, dtype=proj.dtype)
    work = gdn_work(hk, hv, dk, dv, rows)
    pointers = torch.tensor(conv_ptrs + state_ptrs, dtype=torch.int64)
    _lib.gdn_decode_rows_bf16(
        proj.data_ptr(), proj.stride(0), rows, taps.data_ptr(), pointers.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
        norm_w.data_ptr(), eps, pointers.data_ptr() + rows * 8, out.data_ptr(), hk, hv, dk, dv, k, work.data_ptr(),
    )
    return out


def gdn_work(hk: int, hv: int, dk: int, dv: int, rows: int = 1) -> torch.Tensor:
    """gdn_decode_bf16's fp32 scratch (of `rows` rows: gdn_decode_rows_bf16's): it depends on the
    shape alone, so it is made once per shape and reused by every call (a process runs its passes
    one at a time)."""
    floats = _lib.gdn_work_floats(hk, hv, dk, dv) * rows
    work = _gdn_work.get(floats)
    if work is None:
        work = _gdn_work[floats] = torch.empty(floats, dtype=torch.float32)
    return work


def attention_work(heads: int, kv_heads: int, head_dim: int, block_size: int, splits: int, isa: str = "native") -> torch.Tensor:
    """attention_decode_bf16's fp32 scratch for up to `splits` ranges of blocks: it depends on the
    shape alone (not on pos), so it is made once per shape and reused by every step."""
    key = (isa, heads, kv_heads, head_dim, block_size, splits)
    work = _attention_work.get(key)
    if work is None:
        lib, why = attention_library(isa)
        if lib is None:
            raise RuntimeError(why)
        work = _attention_work[key] = torch.empty(lib.attention_decode_work_floats(heads, kv_heads, head_dim, block_size, splits), dtype=torch.float32)
    return work


def attention_splits(pos: int, kv_heads: int, head_dim: int, block_size: int, threads: int) -> int:
    """Ranges the sequence's blocks are cut into: one per thread, one in all for a short cache."""
    if (pos + 1) * kv_heads * head_dim < ATTENTION_PARALLEL_MIN:
        return 1
    return max(1, min(threads, pos // block_size + 1))


def attention_decode(qkv, q_scale, k_scale, eps: float, cos, sin, k_pool, v_pool, table, pos: int, heads: int, kv_heads: int, head_dim: int,
                     scale: float, splits: int | None = None, isa: str = "native") -> torch.Tensor:
    """k_pool, v_pool [blocks, kv_heads, block_size, head_dim] (layers/cache.py); table: the
    sequence's block ids, int32, covering position pos. `splits` (ranges of blocks, default
    attention_splits on torch's threads) and `isa` (a narrower path than this CPU's widest, one
    of compiled.ISA_FLAGS) are for tests: the result is the same for any, up to fp32 summation order."""
    half = cos.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    d = head_dim
    if not (
        qkv.dtype is _BF16 and qkv.numel() == (heads * 2 + kv_heads * 2) * d and qkv.is_cpu
        and q_scale.dtype is _F32 and q_scale.numel() == d and q_scale.is_contiguous() and q_scale.is_cpu
        and k_scale.dtype is _F32 and k_scale.numel() == d and k_scale.is_contiguous() and k_scale.is_cpu
        and cos.dtype is _F32 and sin.dtype is _F32 and sin.numel() == half and cos.is_cpu and sin.is_cpu
        and k_pool.dtype is _BF16 and k_pool.dim() == 4 and k_pool.shape[1] == kv_heads and k_pool.shape[3] == d
        and k_pool.is_contiguous() and k_pool.is_cpu and v_pool.dtype is _BF16 and v_pool.shape == k_pool.shape
        and v_pool.is_contiguous() and v_pool.is_cpu and table.dtype is _I32 and table.dim() == 1 and table.is_contiguous() and table.is_cpu
        and 0 <= pos < table.numel() * k_pool.shape[2] and 2 * half <= d
    ):
        _refuse_attention(qkv, q_scale, k_scale, cos, sin, k_pool, v_pool, table, heads, kv_heads, d, pos, half)
    if heads % kv_heads:
        raise ValueError(f"attention_decode_bf16: {heads} query heads do not share {kv_heads} KV heads evenly")
    bs = k_pool.shape[2]
    if splits is None:
        splits = attention_splits(pos, kv_heads, head_dim, bs, torch.get_num_threads())
    elif splits < 1:
        raise ValueError(f"attention_decode_bf16: splits must be at least 1, got {splits}")
    out = torch.empty(1, heads * head_dim, dtype=qkv.dtype)
    lib, why = attention_library(isa)
    if lib is None:
        raise RuntimeError(why)
    work = attention_work(heads, kv_heads, head_dim, bs, splits, isa)
    # The kernel checks the table's ids against the pool before it reads or writes anything: a bad
    # one would read outside it.
    if lib.attention_decode_bf16(
        qkv.data_ptr(), q_scale.data_ptr(), k_scale.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        k_pool.shape[0], table.data_ptr(), bs, pos, heads, kv_heads, head_dim, half, scale, out.data_ptr(), work.data_ptr(), splits,
    ):
        raise ValueError(f"attention_decode_bf16: table holds block ids outside the pool's {k_pool.shape[0]} blocks")
    return out


def _refuse_attention(qkv, q_scale, k_scale, cos, sin, k_pool, v_pool, table, heads: int, kv_heads: int, head_dim: int, pos: int, half: int) -> None:
    name = "attention_decode_bf16"
    specs = [
        ("qkv", qkv, _BF16, (heads * 2 + kv_heads * 2) * head_dim, True, None), ("q_scale", q_scale, _F32, head_dim, True, None),
        ("k_scale", k_scale, _F32, head_dim, True, None), ("cos", cos, _F32, half, True, None), ("sin", sin, _F32, half, True, None),
        ("k_pool", k_pool, _BF16, None, True, 4), ("v_pool", v_pool, _BF16, None, True, 4), ("table", table, _I32, None, True, 1),
    ]
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
    _lib.add_rms_norm_rows_bf16(h.data_ptr(), _ptr(x), scale.data_ptr(), eps, n, rows, _ptr(h_out if x is not None else None), y.data_ptr())
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
    _lib.silu_mul_rows_bf16(gate.data_ptr(), up.data_ptr(), gate.stride(0), n, rows, out.data_ptr())
    return out


def conv_silu_rows(x: torch.Tensor, taps: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """causal_conv1d_prefill_ (ops/causal_conv.py) for a prompt segment's rows x [t, ch] (rows may
    be a view's, a stride apart): silu(conv) [t, ch], conv_state [K-1, ch] advanced in place."""
    t, ch = x.shape[0], x.shape[-1]
    k = taps.shape[0]
    if not (
        x.dtype is _BF16 and x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= ch and x.is_cpu
        and taps.dtype is _F32 and taps.shape == (k, ch) and taps.is_contiguous() and taps.is_cpu
        and conv_state.dtype is _BF16 and conv_state.shape == (k - 1, ch) and conv_state.is_contiguous() and conv_state.is_cpu
    ):
        refuse("conv_silu_rows_bf16", [
            ("x", x, _BF16, None, False, 2), ("taps", taps, _F32, k * ch, True, 2), ("conv_state", conv_state, _BF16, (k - 1) * ch, True, 2),
        ])
    out = torch.empty(t, ch, dtype=_BF16)
    _lib.conv_silu_rows_bf16(x.data_ptr(), x.stride(0), t, ch, taps.data_ptr(), k, conv_state.data_ptr(), out.data_ptr())
    return out


def rms_norm_gated_rows(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_gated (ops/norms.py) for a prompt segment: x [t, hv, dv] bf16, z [t, hv, dv] (a
    view whose heads are dv apart), weight [dv] bf16 -> [t, hv, dv]."""
    t, hv, dv = x.shape
    if not (
        x.dtype is _BF16 and x.is_contiguous() and x.is_cpu and z.dtype is _BF16 and z.shape == x.shape and z.stride(2) == 1
        and z.stride(1) == dv and z.is_cpu and weight.dtype is _BF16 and weight.numel() == dv and weight.is_contiguous()
    ):
        refuse("rms_norm_gated_rows_bf16", [
            ("x", x, _BF16, None, True, 3), ("z", z, _BF16, x.numel(), False, 3), ("weight", weight, _BF16, dv, True, None),
        ])
    out = torch.empty(t, hv, dv, dtype=_BF16)
    _lib.rms_norm_gated_rows_bf16(x.data_ptr(), z.data_ptr(), z.stride(0), hv, weight.data_ptr(), eps, dv, t * hv, out.data_ptr())
    return out

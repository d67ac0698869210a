"""The compiled decode step (step_bf16.c): its C structures as ctypes mirrors, and the call.

A step is described once (Step: every layer's weights, chosen kernels and the work between them,
by address) and then run per token with the sequence's state (SeqLayer per layer). The
description holds raw pointers: `keep` holds the tensors and objects they point into, so they
live as long as it does. pocketllm.models.compiled_step builds it from a loaded model."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pocketllm import compiled
from pocketllm.ops.fused import kernels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SOURCE = Path(__file__).with_name("step_bf16.c")
PROJ_BF16, PROJ_QUANT, PROJ_BF16_ROWS, PROJ_QUANT_EACH = 0, 1, 2, 3


class Proj(ctypes.Structure):
    _fields_ = [("kind", _I), ("fn", _P), ("w", _P), ("rows", _I), ("n", _I), ("a", _I), ("b", _I)]


class Layer(ctypes.Structure):
    _fields_ = [
        ("full", _I), ("in_scale", _P), ("post_scale", _P), ("in_eps", _F), ("post_eps", _F), ("inter", _I),
        ("taps", _P), ("neg_a", _P), ("dt_bias", _P), ("norm_w", _P), ("norm_eps", _F),
        ("hk", _I), ("hv", _I), ("dk", _I), ("dv", _I), ("kernel", _I),
        ("q_scale", _P), ("k_scale", _P), ("qk_eps", _F), ("attn_scale", _F),
        ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("half", _I), ("attn_work", _P),
        ("attn_rows_work", _P), ("attn_rows_stride", _I),
    ]


class SeqLayer(ctypes.Structure):
    _fields_ = [("conv", _P), ("k_pool", _P), ("v_pool", _P), ("state", _P), ("table", _P), ("num_blocks", _I), ("block_size", _I)]


class Step(ctypes.Structure):
    _fields_ = [
        ("layers", _I), ("hidden", _I), ("layer", _P), ("final_scale", _P), ("final_eps", _F), ("proj", _P), ("rows_max", _I),
        ("add_rms_norm", _P), ("silu_mul", _P), ("gdn_decode", _P), ("gdn_decode_rows", _P), ("attention_decode", _P),
        ("threads", _I), ("attention_parallel_min", _I),
        ("capacity", _I), ("h", _P), ("x", _P), ("y", _P), ("proj_out", _P), ("mid", _P), ("head_row", _P), ("gdn_work", _P),
    ]


_lib: ctypes.CDLL | None = None


def library() -> tuple[ctypes.CDLL | None, str]:
    """(step_bf16.c built, "") once it and the decode ops it calls are built, else (None, why not)."""
    global _lib
    ops, why = kernels.library()
    if ops is None:
        return None, why
    lib, why = compiled.load(SOURCE)
    if lib is None:
        return None, why
    lib.decode_step_bf16.argtypes = [_P, _P, _I, _P, _P, _P, _P]
    lib.decode_step_bf16.restype = ctypes.c_int
    lib.decode_rows_bf16.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P]
    lib.decode_rows_bf16.restype = ctypes.c_int
    lib.logits_argmax.argtypes = [_P, _I]
    lib.logits_argmax.restype = _I
    lib.logits_argmax_rows.argtypes = [_P, _I, _I, _P]
    lib.logits_argmax_rows.restype = None
    _lib = lib
    return lib, ""


def address(fn) -> int:
    """A ctypes function's entry point."""
    return ctypes.cast(fn, _P).value


def op_addresses() -> dict[str, int]:
    """The work between GEMVs, by the Step field each fills."""
    ops, attn = kernels.library()[0], kernels.attention_library()[0]
    return {
        "add_rms_norm": address(ops.add_rms_norm_bf16), "silu_mul": address(ops.silu_mul_bf16),
        "gdn_decode": address(ops.gdn_decode_bf16), "gdn_decode_rows": address(ops.gdn_decode_rows_bf16),
        "attention_decode": address(attn.attention_decode_bf16),
    }


def run(step: Step, embed: int, pos: int, cos: int, sin: int, seq, logits: int) -> None:
    """One decode step (step_bf16.c): `embed` the address of the token's embedding row, cos and
    sin of its rotary row, `seq` a SeqLayer array, fp32 logits [vocab] written at `logits`."""
    _check(_lib.decode_step_bf16(ctypes.byref(step), embed, pos, cos, sin, seq, logits))


def run_rows(step: Step, count: int, embed, pos, cos, sin, seq, logits: int) -> None:
    """Several sequences' decode rows (step_bf16.c's decode_rows_bf16): embed, pos, cos, sin and
    seq ctypes arrays of `count` entries (addresses, positions, SeqLayer array addresses), fp32
    logits [count, vocab] written at `logits`."""
    rc = _lib.decode_rows_bf16(ctypes.byref(step), count, embed, pos, cos, sin, seq, logits)
    if rc == 3:
        raise ValueError(f"decode rows: {count} rows exceed the {step.capacity} the scratch holds")
    _check(rc)


def _check(rc: int) -> None:
    if rc == 1:
        raise MemoryError("decode step: a quantized projection could not allocate its scratch for x")
    if rc == 2:
        raise ValueError("decode step: a block table holds block ids outside its KV pool")


def argmax(logits: torch.Tensor) -> int:
    """torch.argmax of fp32 logits (contiguous, on the CPU) as step_bf16.c finds it."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous():
        raise ValueError(f"argmax: fp32 contiguous CPU logits, got {logits.dtype} on {logits.device}")
    lib, why = library() if _lib is None else (_lib, "")
    if lib is None:
        raise RuntimeError(f"argmax: {why}")
    return argmax_at(logits.data_ptr(), logits.numel())


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """Each row's argmax of fp32 logits [rows, V] on the CPU, as torch.argmax chooses, found by
    step_bf16.c's loop where that library is loaded already; None where it is not (or the logits
    are of another kind), so the caller asks torch."""
    if _lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or not logits.is_contiguous():
        return None
    rows = logits.shape[0]
    out = (ctypes.c_int64 * rows)()
    _lib.logits_argmax_rows(logits.data_ptr(), rows, logits.shape[1], out)
    return list(out)


def argmax_at(logits: int, n: int) -> int:
    """The same over n fp32 logits at an address (a buffer the step writes)."""
    return _lib.logits_argmax(logits, n)

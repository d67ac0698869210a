"""ctypes wrappers of the compiled quantized kernels (gemv_int4.c, gemv_int8.c, dequant.c).

They pass raw pointers, so every argument is checked first: a wrong dtype, shape, device or
stride is one ValueError naming the argument, never a read out of bounds. The weight is checked
once, when it is prepared (`prepare` gives a CompiledWeight holding its pointers); a call then
checks only x and out, in one expression of attribute reads, and looks for the argument at fault
only when that fails. A QuantizedWeight passed as is is prepared on the spot.

`library(name, isa)` builds a source for this CPU ("native") or, for tests and benchmarks, with
its wider paths switched off ("avx512f": no AVX-512 BF16; "avx2": no AVX-512; "scalar": no AVX), so
every path can be checked on one machine.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pocketllm import compiled
from pocketllm.ops.quant.layout import QuantizedWeight

HERE = Path(__file__).parent
SOURCES = {
    "int4": HERE / "gemv_int4.c", "int8": HERE / "gemv_int8.c", "dequant": HERE / "dequant.c",
    "int4-int8x": HERE / "gemv_int4_int8x.c", "int8-int8x": HERE / "gemv_int8_int8x.c",
    "int8x-many": HERE / "gemm_int8x.c",
}
# The scale dtypes the kernels read as stored, by the code quant.h gives them.
SCALE_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "q4_gemm": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "q8_gemm": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "q4_dequant": (None, [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64]),
    "q8_dequant": (None, [_ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64]),
    "q4x_gemm": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "q8x_gemm": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "q8x_gemm4": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "q8x_gemm_blocked": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "q8x_has_blocked": (ctypes.c_int, []),
    "q8x_isa": (ctypes.c_char_p, []),
    "q4x_many": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "q8x_many": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "int8x_many_isa": (ctypes.c_char_p, []),
    "q8x_tile_rows": (ctypes.c_int, []),
    "q4_isa": (ctypes.c_char_p, []),
    "q4x_isa": (ctypes.c_char_p, []),
    "q8_isa": (ctypes.c_char_p, []),
}
def library(name: str, isa: str = "native") -> tuple[ctypes.CDLL | None, str]:
    """(the built library of SOURCES[name] for `isa`, "") or (None, why not)."""
    return compiled.load(SOURCES[name], compiled.FLAGS + compiled.ISA_FLAGS[isa], _SIGNATURES)


def unavailable(name: str, isa: str = "native") -> str:
    """Why the compiled kernels of SOURCES[name] cannot run here ("" when they can)."""
    return library(name, isa)[1]


# Each source's function naming the instruction set it was built for.
_ISA_FN = {"int4": "q4_isa", "int8": "q8_isa", "int4-int8x": "q4x_isa", "int8-int8x": "q8x_isa", "int8x-many": "int8x_many_isa"}


def isa(scheme: str, variant: str = "native") -> str:
    """The instruction set the scheme's GEMV (or "int4-int8x", "int8-int8x", "int8x-many") was built for, or why it was not."""
    lib, why = library(scheme, variant)
    if lib is None:
        return f"unavailable: {why}"
    return getattr(lib, _ISA_FN[scheme])().decode()


def _unbuilt(source: str, variant: str) -> str:
    """Why SOURCES[source]'s kernel is not in its `variant` build ("" when it is)."""
    return compiled.unbuilt(library(source, variant), _ISA_FN[source])


def int8x_unavailable(variant: str = "native", scheme: str = "int4") -> str:
    """Why the scheme's int8-x kernel (gemv_int4_int8x.c, gemv_int8_int8x.c) cannot run here ("" when it can)."""
    return _unbuilt(f"{scheme}-int8x", variant)


def int4_group_ok(group: int) -> bool:
    """Groups the compiled int4 kernels take: 32, or a multiple of 64 (a step of their loop)."""
    return group == 32 or (group > 0 and group % 64 == 0)


class _Q4Weight(ctypes.Structure):
    """struct q4_weight in gemv_int4.c."""

    _fields_ = [("w", _ptr), ("s", _ptr), ("kind", _i64), ("z", _ptr), ("rows", _i64), ("n", _i64), ("group", _i64)]


class _Q8Weight(ctypes.Structure):
    """struct q8_weight in gemv_int8.c."""

    _fields_ = [("w", _ptr), ("s", _ptr), ("kind", _i64), ("rows", _i64), ("n", _i64)]


class CompiledWeight:
    """A QuantizedWeight checked for the compiled kernels, with the description of it they take
    (its address is one argument: a call converts five arguments, not eleven)."""

    __slots__ = ("qw", "scheme", "out_features", "in_features", "group", "kind", "desc", "address")

    def __init__(self, qw: QuantizedWeight, kernel: str = "quantized kernel"):
        check_weight(qw, kernel)
        self.qw = qw  # keeps the tensors the pointers point into alive
        self.scheme = qw.scheme
        self.out_features, self.in_features = qw.shape
        self.group = qw.group
        self.kind = SCALE_KINDS[qw.scales.dtype]
        w, s = qw.qweight.data_ptr(), qw.scales.data_ptr()
        if qw.scheme == "int4":
            z = None if qw.zeros is None else qw.zeros.data_ptr()
            self.desc = _Q4Weight(w, s, self.kind, z, self.out_features, self.in_features, self.group)
        else:
            self.desc = _Q8Weight(w, s, self.kind, self.out_features, self.in_features)
        self.address = ctypes.addressof(self.desc)


def prepare(qw: QuantizedWeight) -> CompiledWeight:
    return CompiledWeight(qw)


def _tensor_problem(name: str, t, dtype: torch.dtype, shape: tuple[int, ...] | None) -> str:
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a tensor, got {type(t).__name__}"
    if t.device.type != "cpu":
        return f"{name} must be on the CPU, got {t.device}"
    if t.dtype != dtype:
        return f"{name} must be {str(dtype).removeprefix('torch.')}, got {str(t.dtype).removeprefix('torch.')}"
    if shape is not None and tuple(t.shape) != shape:
        return f"{name} must have shape {shape}, got {tuple(t.shape)}"
    if not t.is_contiguous():
        return f"{name} must be contiguous, got strides {t.stride()}"
    return ""


def check_weight(qw, kernel: str = "quantized kernel") -> None:
    """Raise one ValueError naming what in `qw` the compiled kernels cannot read."""
    if not isinstance(qw, QuantizedWeight):
        raise ValueError(f"{kernel}: the weight must be a QuantizedWeight, got {type(qw).__name__}")
    if qw.scheme not in ("int8", "int4"):
        raise ValueError(f"{kernel}: scheme {qw.scheme!r} is not int8 or int4")
    if qw.qweight.dim() != 2:
        raise ValueError(f"{kernel}: qweight must have 2 dimensions, got shape {tuple(qw.qweight.shape)}")
    out, cols = qw.shape
    if qw.scheme == "int8" and qw.group != cols:
        raise ValueError(f"{kernel}: int8 has one scale per row (group {cols}), got group {qw.group}")
    if qw.scheme == "int4" and not int4_group_ok(qw.group):
        raise ValueError(f"{kernel}: int4 group {qw.group} is not 32 or a multiple of 64")
    if cols == 0 or out == 0 or cols % qw.group:
        raise ValueError(f"{kernel}: {cols} inputs do not split into groups of {qw.group}")
    if qw.scales.dtype not in SCALE_KINDS:
        raise ValueError(f"{kernel}: scales must be bfloat16, float16 or float32, got {str(qw.scales.dtype).removeprefix('torch.')}")
    groups = cols // qw.group
    wdtype = torch.uint8 if qw.scheme == "int4" else torch.int8
    problem = (
        _tensor_problem("qweight", qw.qweight, wdtype, None)
        or _tensor_problem("scales", qw.scales, qw.scales.dtype, (out, groups))
        or ("" if qw.zeros is None else _tensor_problem("zeros", qw.zeros, torch.uint8, (out, groups)))
    )
    if problem:
        raise ValueError(f"{kernel}: {problem}")
    if qw.zeros is not None and qw.scheme == "int8":
        raise ValueError(f"{kernel}: int8 weights have no zero points")


_BF16 = torch.bfloat16
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_io(kernel: str, x, w: CompiledWeight, out) -> int:
    """The number of x rows, after checking x [in] / out [out] or x [m, in] / out [m, out], both
    of one activation dtype (bf16, fp16 or fp32), contiguous, on the CPU."""
    if (
        isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)
        and x.dtype is out.dtype and x.dtype in ACTIVATION_DTYPES and x.is_cpu and out.is_cpu
        and 1 <= x.ndim <= 2 and x.ndim == out.ndim and x.shape[-1] == w.in_features and out.shape[-1] == w.out_features
        and x.numel() * w.out_features == out.numel() * w.in_features and x.numel() > 0
        and x.is_contiguous() and out.is_contiguous()
    ):
        return x.numel() // w.in_features
    if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2) or x.numel() == 0:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{kernel}: x must be [{w.in_features}] or [rows, {w.in_features}] with rows >= 1, got {got}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{kernel}: x must be bfloat16, float16 or float32, got {str(x.dtype).removeprefix('torch.')}")
    lead = tuple(x.shape[:-1])
    problem = _tensor_problem("x", x, x.dtype, (*lead, w.in_features)) or _tensor_problem("out", out, x.dtype, (*lead, w.out_features))
    raise ValueError(f"{kernel}: {problem or 'arguments do not fit together'}")


# What blocked_product dequantizes at a time: about BLOCK_BYTES of bf16, at least MIN_BLOCK_ROWS
# rows. Smaller blocks cut torch's GEMM into calls too small to run at its full rate; blocks this
# size ran a prefill's GEMMs as fast as one GEMM of the whole bf16 weight (docs/measuring.md,
# figures behind the code's choices).
BLOCK_BYTES = 4 << 20
MIN_BLOCK_ROWS = 256


def block_rows(w: CompiledWeight) -> int:
    return min(w.out_features, max(MIN_BLOCK_ROWS, BLOCK_BYTES // (2 * w.in_features) // 64 * 64))


def blocked_product(x: torch.Tensor, w: CompiledWeight, out: torch.Tensor, block_dtype: torch.dtype, variant: str = "native") -> None:
    """out = x @ W^T with W dequantized block_rows(w) rows at a time into block_dtype (bf16 or fp32)
    and multiplied by torch's GEMM of that dtype (x converted to it): only one block is ever held
    unpacked. x and out already checked (check_io)."""
    x2, out2 = (x, out) if x.dim() == 2 else (x[None], out[None])
    xc = x2 if x2.dtype == block_dtype else x2.to(block_dtype)
    rows = block_rows(w)
    block = torch.empty(rows, w.in_features, dtype=block_dtype)
    part = torch.empty(x2.shape[0], rows, dtype=block_dtype)
    for o0 in range(0, w.out_features, rows):
        o1 = min(o0 + rows, w.out_features)
        blk = block[: o1 - o0]
        dequantize_rows(w, o0, o1, blk, variant)
        if o1 - o0 == rows:
            out2[:, o0:o1] = torch.mm(xc, blk.t(), out=part)
        else:  # the last, shorter block
            out2[:, o0:o1] = xc @ blk.t()


# int8's int8-x few-row kernel in another form, each with the same bits (gemv_int8_int8x.c): its
# entry point, and what a build without it lacks.
INT8X_FORMS = {"four": ("q8x_gemm4", "four-row int8-x tile"), "blocked": ("q8x_gemm_blocked", "blocked int8-x form (AVX2 has it)")}


def _function(scheme: str, variant: str, int8_x: bool, form: str = "", many: bool = False):
    if many:
        lib, why = library("int8x-many", variant)
        if lib is None:
            raise RuntimeError(why)
        return lib.q4x_many if scheme == "int4" else lib.q8x_many
    source = f"{scheme}-int8x" if int8_x else scheme
    lib, why = library(source, variant)
    if lib is None:
        raise RuntimeError(why)
    if form:
        if source != "int8-int8x":
            raise ValueError(f"the {INT8X_FORMS[form][1]} takes int8 weights, got {scheme}")
        return getattr(lib, INT8X_FORMS[form][0])
    return getattr(lib, {"int4": "q4_gemm", "int8": "q8_gemm", "int4-int8x": "q4x_gemm", "int8-int8x": "q8x_gemm"}[source])


def int8x_form_unavailable(form: str, variant: str = "native") -> str:
    """Why int8's int8-x kernel in `form` (INT8X_FORMS: "four" weight rows a tile, AVX-512 VNNI;
    "blocked" for the caches, AVX2) cannot run here ("" when it can)."""
    lib, why = library("int8-int8x", variant)
    if lib is None:
        return why
    built = lib.q8x_tile_rows() >= 4 if form == "four" else bool(lib.q8x_has_blocked())
    return "" if built else f"no {INT8X_FORMS[form][1]} in the {isa('int8-int8x', variant)} build"


def int8x_many_unavailable(variant: str = "native") -> str:
    """Why the many-row int8-x GEMM (gemm_int8x.c) cannot run here ("" when it can)."""
    return _unbuilt("int8x-many", variant)


# Where a compiled kernel's weight prefetch puts the lines (ops/prefetch.h prefetch_weight, PF_*): past the
# outer caches, into every cache level, or into L2 and beyond but not L1.
NON_TEMPORAL, ALL_LEVELS, L2 = 0, 1, 2


def gemv(prefetch: int, variant: str = "native", where: int = NON_TEMPORAL, int8_x: bool = False, form: str = "", many: bool = False):
    """The compiled one-row/few-row kernel for either scheme, each weight load prefetched `prefetch`
    bytes ahead (0: none) to `where` (NON_TEMPORAL, ALL_LEVELS or L2): run(x, w, out), x [in] or [m, in],
    w a QuantizedWeight or its CompiledWeight, out [out] or [m, out]. The C takes bf16 activations;
    fp16 and fp32 ones (an fp32 run's) go through fp32 blocks of the weight into torch's GEMM,
    which multiplies the reference's very weights. `int8_x`: the scheme's int8-x kernel
    (gemv_int4_int8x.c for symmetric int4, gemv_int8_int8x.c), which rounds bf16 x to int8 first;
    `form` one of INT8X_FORMS: int8's int8-x kernel four weight rows a tile or blocked for the
    caches (the same bits each); with `many`, the many-row int8-x GEMM (gemm_int8x.c: int8 or int4
    with or without zero points, x rounded as int8_x rounds it)."""
    name = f"quantized {'GEMM' if many else 'GEMV'} ({variant}{', int8 x' if int8_x or many else ''}{', ' + form if form else ''})"
    fns = {}  # scheme -> its C function, looked up (and built) on the first call

    def fn_for(scheme: str):
        return fns.get(scheme) or fns.setdefault(scheme, _function(scheme, variant, int8_x, form, many))

    def run(x, w, out) -> None:
        if type(w) is not CompiledWeight:
            w = CompiledWeight(w, name)
        m = check_io(name, x, w, out)
        if x.dtype is not _BF16:
            blocked_product(x, w, out, torch.float32, variant)
            return
        fn = fn_for(w.scheme)
        rc = fn(w.address, x.data_ptr(), out.data_ptr(), m, prefetch, where)
        if rc != 0:
            _failed(name, rc, w, m, variant, form, many)

    def native(w) -> tuple | None:
        """This kernel on a prepared weight as compiled code calls it (ops/fused/step_bf16.c, bf16
        x): ("quant", entry point, the weight's description, rows, n, prefetch, where)."""
        if type(w) is not CompiledWeight:
            return None
        return "quant", ctypes.cast(fn_for(w.scheme), ctypes.c_void_p).value, w.address, w.out_features, w.in_features, prefetch, where

    run.native = native
    return run


def _failed(name: str, rc: int, w: CompiledWeight, m: int, variant: str, form: str = "", many: bool = False) -> None:
    """The one error a compiled GEMV's return code `rc` stands for (checked off the hot path)."""
    if rc == -1:
        raise MemoryError(f"{name}: no memory for x's scratch ({m} x {w.in_features})")
    if many:
        raise RuntimeError(f"{name}: {int8x_many_unavailable(variant) or f'returned {rc}'}")
    if form and int8x_form_unavailable(form, variant):
        raise RuntimeError(f"{name}: {int8x_form_unavailable(form, variant)}")
    if w.scheme == "int4" and w.qw.zeros is not None:
        raise ValueError(f"{name}: takes symmetric int4 weights, got int4 with zero points")
    raise RuntimeError(f"{name}: {isa(f'{w.scheme}-int8x', variant)}")


def dequantize_rows(w, r0: int, r1: int, block: torch.Tensor, variant: str = "native") -> None:
    """Rows r0:r1 of the weight as block [r1 - r0, in] (bf16 or fp32, contiguous): (q - zero) *
    scale in fp32, rounded once for bf16."""
    if type(w) is not CompiledWeight:
        w = CompiledWeight(w, "dequantize_rows")
    if not 0 <= r0 < r1 <= w.out_features:
        raise ValueError(f"dequantize_rows: rows {r0}:{r1} are not within 0:{w.out_features}")
    problem = ""
    if block.dtype not in (torch.bfloat16, torch.float32):
        problem = f"block must be bfloat16 or float32, got {str(block.dtype).removeprefix('torch.')}"
    problem = problem or _tensor_problem("block", block, block.dtype, (r1 - r0, w.in_features))
    if problem:
        raise ValueError(f"dequantize_rows: {problem}")
    lib, why = library("dequant", variant)
    if lib is None:
        raise RuntimeError(why)
    f32 = int(block.dtype == torch.float32)
    d = w.desc
    if w.scheme == "int4":
        lib.q4_dequant(d.w, d.s, d.kind, d.z, block.data_ptr(), f32, r0, r1, w.in_features, w.group)
    else:
        lib.q8_dequant(d.w, d.s, d.kind, block.data_ptr(), f32, r0, r1, w.in_features)

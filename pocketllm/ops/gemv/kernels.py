"""The one-row (decode) projection kernels: y = W x for a single row, each with the signature
`kernel(x [in], w [out, in], out [out]) -> None`, writing into `out`; and the few-row kernels for a
decode step of several sequences, `kernel(x [m, in], w [out, in], out [m, out]) -> None`.

Which is fastest depends on the CPU: torch.mv's bf16 path goes through oneDNN, which on some CPUs
streams the weight at a third of the speed of torch's own kernel and on others is the fastest;
the kernel registry (pocketllm.ops.registry) times them on the machine that runs and picks per
weight shape. The compiled kernels check their arguments before passing pointers
(pocketllm.ops.native_args).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from pocketllm import compiled
from pocketllm.ops.native_args import refuse

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def gemv_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The plain form every kernel must equal (up to fp32 summation order): fp32 products and
    sums, rounded once to out's dtype."""
    out.copy_(w.float() @ x.float())


def mv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mv(w, x, out=out)


def mv_native(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    # oneDNN off for this call only: prefill's GEMMs keep it.
    torch._C._set_mkldnn_enabled(False)
    try:
        torch.mv(w, x, out=out)
    finally:
        torch._C._set_mkldnn_enabled(True)


def mm_one_row(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x[None], w.t(), out=out[None])


SOURCE = Path(__file__).with_name("gemv_bf16.c")


_configured = None  # the library object whose entry points the names below hold
_c_gemv = None
_c_gemv_group = None
_amx_gemm_rows = None
_amx_gemv = None
# The few-row entry points by symbol, all (w, x, y, rows, n, m, a, b): set when the library loads.
_c_rows: dict[str, object] = {}
_amx_enabled: bool | None = None


_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "gemv_bf16": (None, [_P, _P, _P] + [_I] * 4),
    "gemv_bf16_group": (None, [_P, _P, _P] + [_I] * 4),
    "gemm_rows_bf16": (None, [_P, _P, _P] + [_I] * 5),
    "gemm_rows_amx_bf16": (None, [_P, _P, _P] + [_I] * 3),
    "gemm_rows_next_bf16": (None, [_P, _P, _P] + [_I] * 5),
    "gemm_rows_wide_bf16": (ctypes.c_int, [_P, _P, _P] + [_I] * 5),
    "gemm_rows_blocked_bf16": (ctypes.c_int, [_P, _P, _P] + [_I] * 5),
    "gemv_amx_bf16": (None, [_P, _P, _P] + [_I] * 4),
    "amx_bf16_enable": (ctypes.c_int, None),
    "gemv_bf16_isa": (ctypes.c_char_p, None),
    "gemv_bf16_group_rows": (ctypes.c_int, None),
}


def _compiled_library() -> tuple[ctypes.CDLL | None, str]:
    global _c_gemv, _c_gemv_group, _amx_gemm_rows, _amx_gemv, _configured, _amx_enabled
    lib, why = compiled.load(SOURCE, signatures=_SIGNATURES)
    # Each library object once: a process whose build changes (another POCKETLLM_ISA or cache
    # directory, as tests run) gets a new one, whose entry points then take over.
    if lib is not None and lib is not _configured:
        _configured = lib
        _amx_enabled = None  # this build's own answer: one held to AVX-512F has no tiles
        _c_gemv, _c_gemv_group, _amx_gemm_rows, _amx_gemv = lib.gemv_bf16, lib.gemv_bf16_group, lib.gemm_rows_amx_bf16, lib.gemv_amx_bf16
        _c_rows.update(
            gemm_rows_bf16=lib.gemm_rows_bf16, gemm_rows_next_bf16=lib.gemm_rows_next_bf16, gemm_rows_wide_bf16=lib.gemm_rows_wide_bf16,
            gemm_rows_blocked_bf16=lib.gemm_rows_blocked_bf16,
        )
    return lib, why


# How far ahead the few-row c-prefetch asks for each weight row (non-temporally, gemv_bf16.c says
# why): four cache lines, enough to cover the memory's latency at one core's streaming rate. The
# one-row kernel reads only whether it is nonzero: it asks for whole rows a fixed count ahead.
PREFETCH_BYTES = 256
# How far ahead c-ahead asks for each weight row into every cache level: far enough that many more
# lines are in flight than one core's hardware prefetchers keep (docs/decode.md has the sweep).
AHEAD_BYTES = 4096
# How far into the next block of weight rows c-next asks, on top of the block itself (the sweep of
# 0 / 512 / 2048 / 8192 is in docs/batching.md).
NEXT_AHEAD_BYTES = 2048
# The wide few-row tiles' distances: one weight row at a time keeps a single stream per thread and
# needs less lead than the four-row tile; two rows at a time, more (docs/batching.md has the sweep).
WIDE_AHEAD_BYTES = 2048
WIDE2_AHEAD_BYTES = 16384
# How much of x's rows (widened to fp32) the blocked few-row GEMM runs a block of weight rows over
# at a time: half of a 32 KiB L1, so the weight's lines and the sums fit beside it; and the weight
# rows in a block (the sweep of 4 to 64 rows at the 27B and small widths is in docs/batching.md).
BLOCKED_X_BYTES = 16384
BLOCKED_ROWS = 32


_BF16 = torch.bfloat16


def _gemv_specs(x, w, out):
    n, o = (w.shape[1], w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else (None, None)
    return [("w", w, _BF16, None, True, 2), ("x", x, _BF16, n, False, None), ("out", out, _BF16, o, True, None)]


def rows_specs(x, w, out):
    """refuse()'s specs for a compiled GEMM of many rows: x [m, n], w [rows, n], out [m, rows]."""
    n, o = (w.shape[1], w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else (None, None)
    m = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None
    specs = [("w", w, _BF16, None, True, 2), ("x", x, _BF16, None if m is None else m * n, False, 2)]
    return specs + [("out", out, _BF16, None if m is None else m * o, True, 2)]


def _gemv_call(symbol: str, fn, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, a: int, b: int) -> None:
    """A checked call of a compiled one-row entry point (w, x, y, rows, n, a, b)."""
    # One expression of attribute reads on the hot path; refuse() says which argument broke it.
    s = w.shape
    if not (
        len(s) == 2 and x.dtype is _BF16 and w.dtype is _BF16 and out.dtype is _BF16 and x.numel() == s[1] and out.numel() == s[0]
        and w.is_contiguous() and out.is_contiguous() and w.is_cpu and x.is_cpu and out.is_cpu
    ):
        refuse(symbol, _gemv_specs(x, w, out))
    if not x.is_contiguous():
        x = x.contiguous()
    fn(w.data_ptr(), x.data_ptr(), out.data_ptr(), s[0], s[1], a, b)


def compiled_gemv(prefetch: int, ahead: int = 0, group: bool = False) -> Kernel:
    """The compiled GEMV; `prefetch` nonzero: each weight row is also asked for non-temporally a
    few rows ahead; `ahead` > 0: each 64 bytes of a row asked for into every cache level that many
    bytes before they are read (both 0: the hardware's prefetchers alone); `group`: four weight
    rows at a time (gemv_bf16_group, where the build has that form), each row's bits the same."""
    symbol = "gemv_bf16_group" if group else "gemv_bf16"

    def entry():
        # Only ever called after unavailable() built the library, which set both (KernelSet.bind
        # checks every kernel it binds).
        return _c_gemv_group if group else _c_gemv

    def run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        _gemv_call(symbol, entry(), x, w, out, prefetch, ahead)

    def native(w: torch.Tensor) -> tuple | None:
        """This kernel on `w` as compiled code calls it (ops/fused/step_bf16.c): ("bf16", entry
        point, weight address, rows, n, prefetch, ahead)."""
        if _compiled_library()[0] is None:
            return None
        return "bf16", ctypes.cast(entry(), ctypes.c_void_p).value, w.data_ptr(), w.shape[0], w.shape[1], prefetch, ahead

    run.native = native
    return run


def group_rows() -> int:
    """The weight rows the built one-row GEMV's grouped form takes at a time (1: the build has no
    such form; 0: no library)."""
    lib, _ = _compiled_library()
    return lib.gemv_bf16_group_rows() if lib is not None else 0


def _built_where(what: str, built) -> Callable[[str, torch.device], str]:
    """A candidate's unavailable(fmt, device) for a form only some builds have: why the compiled
    kernels cannot run, else whether built(isa) holds for the build that loaded."""

    def unavailable(fmt: str, device: torch.device) -> str:
        why = compiled_unavailable(fmt, device)
        if why:
            return why
        isa = compiled_isa()
        return "" if built(isa) else f"no {what} in the {isa} build"

    return unavailable


# The grouped one-row GEMV is built where one row alone may run short of the memory's rate (AVX2).
group_unavailable = _built_where("grouped one-row GEMV", lambda isa: group_rows() > 1)


def rows_ok(x, w, out) -> bool:
    """Whether bf16 x [m, n], w [rows, n], out [m, rows] on the CPU (w and out contiguous) can go
    to a compiled GEMM of many rows: one expression of attribute reads."""
    return (
        x.dtype is _BF16 and w.dtype is _BF16 and out.dtype is _BF16 and w.dim() == 2 and x.dim() == 2 and out.dim() == 2
        and x.shape[1] == w.shape[1] and out.shape[0] == x.shape[0] and out.shape[1] == w.shape[0]
        and w.is_contiguous() and out.is_contiguous() and w.is_cpu and x.is_cpu and out.is_cpu
    )


def _rows_kernel(symbol: str, a: int, b: int) -> Kernel:
    """A checked call of the compiled few-row entry point `symbol` with its two settings a, b."""

    def run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        if not rows_ok(x, w, out):
            refuse(symbol, rows_specs(x, w, out))
        if not x.is_contiguous():
            x = x.contiguous()
        # Only ever bound after unavailable() built the library, which filled _c_rows.
        _c_rows[symbol](w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], x.shape[0], a, b)

    def native(w: torch.Tensor) -> tuple | None:
        """This kernel on `w` as compiled code calls it (ops/fused/step_bf16.c): ("bf16-rows",
        entry point, weight address, rows, n, a, b); the entry takes the row count after n."""
        if _compiled_library()[0] is None:
            return None
        return "bf16-rows", ctypes.cast(_c_rows[symbol], ctypes.c_void_p).value, w.data_ptr(), w.shape[0], w.shape[1], a, b

    run.native = native
    return run


def compiled_rows(prefetch: int, ahead: int = 0) -> Kernel:
    """The compiled few-row GEMM, prefetching each weight row `prefetch` bytes ahead
    non-temporally, or `ahead` bytes ahead into every cache level."""
    return _rows_kernel("gemm_rows_bf16", prefetch, ahead)


def compiled_rows_next(ahead: int) -> Kernel:
    """The compiled few-row GEMM, each weight row's prefetch reaching into the next block of rows
    (the same row of it, `ahead` bytes on), so the memory keeps streaming while a block is read
    again for more x rows."""
    return _rows_kernel("gemm_rows_next_bf16", 0, ahead)


def compiled_wide_rows(wrows: int, ahead: int) -> Kernel:
    """The compiled few-row GEMM with the wide tile: `wrows` (1 or 2) weight rows at a time against
    up to eight x rows, each weight row prefetched `ahead` bytes ahead into every cache level."""
    return _rows_kernel("gemm_rows_wide_bf16", wrows, ahead)


def compiled_blocked_rows(x_bytes: int, rows: int) -> Kernel:
    """The compiled few-row GEMM blocked for the caches (gemm_rows_blocked_bf16, the same bits as
    gemm_rows_bf16): `rows` weight rows at a time against `x_bytes` of x at a time, the next
    block of rows asked for into L2 meanwhile."""
    return _rows_kernel("gemm_rows_blocked_bf16", x_bytes, rows)


# The builds with the blocked few-row GEMM (gemv_bf16.c HAS_BLOCKED).
BLOCKED_BUILDS = ("avx2", "avx512f")


# Built where the tiles read x widened to fp32 (AVX2, AVX-512 without BF16), which at eight x rows
# outgrows L1.
blocked_unavailable = _built_where("blocked few-row GEMM", lambda isa: isa in BLOCKED_BUILDS)


# The builds with a wide tile, and the weight rows at a time each takes (gemv_bf16.c WIDE_ROWS_MAX).
WIDE_ROWS = {"avx512_bf16": (1, 2), "avx512f": (1,)}


def wide_unavailable(wrows: int):
    """Why the wide few-row tile of `wrows` weight rows cannot run here ("" when it can), as a
    candidate's unavailable(fmt, device): it is built on the AVX-512 paths, whose 32 registers
    hold eight x rows' sums."""
    return _built_where(f"wide tile of {wrows} weight rows", lambda isa: wrows in WIDE_ROWS.get(isa, ()))


def amx_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    if not rows_ok(x, w, out):
        refuse("gemm_rows_amx_bf16", rows_specs(x, w, out))
    if not x.is_contiguous():
        x = x.contiguous()
    _amx_gemm_rows(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], x.shape[0])


def amx_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """One row on the AMX tiles: each output the bits it gets as one row of amx_rows."""
    _gemv_call("gemv_amx_bf16", _amx_gemv, x, w, out, 0, 0)


def _amx_native(w: torch.Tensor) -> tuple | None:
    """amx_gemv on `w` as compiled code calls it (ops/fused/step_bf16.c), as compiled_gemv's."""
    if _compiled_library()[0] is None:
        return None
    return "bf16", ctypes.cast(_amx_gemv, ctypes.c_void_p).value, w.data_ptr(), w.shape[0], w.shape[1], 0, 0


amx_gemv.native = _amx_native


def rows_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The plain form every few-row kernel must equal (up to fp32 summation order)."""
    out.copy_(x.float() @ w.float().t())


def compiled_unavailable(fmt: str, device: torch.device) -> str:
    """Why the compiled kernels cannot run weights of `fmt` on `device` ("" when they can)."""
    if device.type != "cpu" or fmt != "bfloat16":
        return "the compiled kernel takes bfloat16 weights on a CPU"
    return _compiled_library()[1]


def amx_unavailable(fmt: str, device: torch.device) -> str:
    """Why the AMX kernel cannot run in this process ("" when it can): the library must build
    with AMX in it (the compiler's -march=native on a CPU that has it) and the kernel must let
    this process use the tile registers, which Linux grants on request."""
    global _amx_enabled
    why = compiled_unavailable(fmt, device)
    if why:
        return why
    if _amx_enabled is None:
        _amx_enabled = bool(_compiled_library()[0].amx_bf16_enable())
    return "" if _amx_enabled else "no AMX tiles here (not on this CPU, not compiled in, or not granted by the kernel)"


def onednn_unavailable(fmt: str, device: torch.device) -> str:
    return "" if device.type == "cpu" else "oneDNN is a CPU library"


def compiled_isa() -> str:
    """The instruction set the compiled kernel was built for, or why it was not."""
    lib, why = _compiled_library()
    return lib.gemv_bf16_isa().decode() if lib is not None else f"unavailable: {why}"

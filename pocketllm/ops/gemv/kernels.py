"""The one-row (decode) projection kernels: y = W x for a single row, each with the signature
`kernel(x [in], w [out, in], out [out]) -> None`, writing into `out`; and the few-row kernels for a
decode step of several sequences, `kernel(x [m, in], w [out, in], out [m, out]) -> None`.

Which is fastest depends on the CPU: torch.mv's bf16 path goes through oneDNN, which on some CPUs
streams the weight at a third of the speed of torch's own kernel and on others is the fastest;
pocketllm.ops.gemv.choice times them on the machine that runs and picks per weight shape.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pocketllm import compiled

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def gemv_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The plain form every kernel must equal (up to fp32 summation order): fp32 products and
    sums, rounded once to out's dtype."""
    out.copy_(w.float() @ x.float())


def _mv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mv(w, x, out=out)


def _mv_native(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    # oneDNN off for this call only: prefill's GEMMs keep it.
    torch._C._set_mkldnn_enabled(False)
    try:
        torch.mv(w, x, out=out)
    finally:
        torch._C._set_mkldnn_enabled(True)


def _mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x[None], w.t(), out=out[None])


SOURCE = Path(__file__).with_name("gemv_bf16.c")


_c_gemv = None
_c_gemm_rows = None
_amx_gemm_rows = None
_amx_enabled: bool | None = None


def _compiled_library() -> tuple[ctypes.CDLL | None, str]:
    global _c_gemv, _c_gemm_rows, _amx_gemm_rows
    lib, why = compiled.load(SOURCE)
    if lib is not None and _c_gemv is None:
        lib.gemv_bf16.restype = None
        lib.gemv_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        lib.gemm_rows_bf16.restype = None
        lib.gemm_rows_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        lib.gemm_rows_amx_bf16.restype = None
        lib.gemm_rows_amx_bf16.argtypes = lib.gemm_rows_bf16.argtypes[:-1]
        lib.amx_bf16_enable.restype = ctypes.c_int
        lib.gemv_bf16_isa.restype = ctypes.c_char_p
        _c_gemv, _c_gemm_rows, _amx_gemm_rows = lib.gemv_bf16, lib.gemm_rows_bf16, lib.gemm_rows_amx_bf16
    return lib, why


# How far ahead c-prefetch asks for each weight row (non-temporally, gemv_bf16.c says why): four
# cache lines, enough to cover the memory's latency at one core's streaming rate.
PREFETCH_BYTES = 256


def _compiled_gemv(prefetch: int) -> Kernel:
    """The compiled GEMV, prefetching each weight row `prefetch` bytes ahead (0: no prefetch)."""

    def run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        # Only ever installed after unavailable() built the library, which set _c_gemv.
        if not x.is_contiguous():
            x = x.contiguous()
        _c_gemv(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], prefetch)

    return run


def _mm_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x, w.t(), out=out)


def _compiled_rows(prefetch: int) -> Kernel:
    """The compiled few-row GEMM, prefetching each weight row `prefetch` bytes ahead."""

    def run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        if not x.is_contiguous():
            x = x.contiguous()
        _c_gemm_rows(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], x.shape[0], prefetch)

    return run


def _amx_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    if not x.is_contiguous():
        x = x.contiguous()
    _amx_gemm_rows(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], x.shape[0])


def amx_unavailable() -> str:
    """Why the AMX kernel cannot run in this process ("" when it can): the library must build
    with AMX in it (the compiler's -march=native on a CPU that has it) and the kernel must let
    this process use the tile registers, which Linux grants on request."""
    global _amx_enabled
    lib, why = _compiled_library()
    if lib is None:
        return why
    if _amx_enabled is None:
        _amx_enabled = bool(lib.amx_bf16_enable())
    return "" if _amx_enabled else "no AMX tiles here (not on this CPU, not compiled in, or not granted by the kernel)"


def rows_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The plain form every few-row kernel must equal (up to fp32 summation order)."""
    out.copy_(x.float() @ w.float().t())


@dataclass(frozen=True)
class Candidate:
    name: str
    run: Kernel
    what: str

    def unavailable(self, dtype: torch.dtype, device: torch.device) -> str:
        """Why this kernel cannot run weights of this dtype on this device ("" when it can)."""
        if self.name in ("c", "c-prefetch", "amx"):
            if device.type != "cpu" or dtype != torch.bfloat16:
                return "the compiled kernel takes bfloat16 weights on a CPU"
            _, why = _compiled_library()
            return why or (amx_unavailable() if self.name == "amx" else "")
        if self.name == "mv-native" and device.type != "cpu":
            return "oneDNN is a CPU library"
        return ""


CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("mv", _mv, "torch.mv (oneDNN for bf16/fp16 where torch has it)"),
        Candidate("mv-native", _mv_native, "torch.mv with oneDNN off (torch's own kernel)"),
        Candidate("mm", _mm, "torch.mm of one row (F.linear's path)"),
        Candidate("c", _compiled_gemv(0), "pocketllm's compiled bf16 GEMV (pocketllm/ops/gemv/gemv_bf16.c)"),
        Candidate("c-prefetch", _compiled_gemv(PREFETCH_BYTES), "the same, each weight row prefetched non-temporally PREFETCH_BYTES ahead"),
    )
}
DEFAULT = "mv"

FEW_ROW_CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("mm", _mm_rows, "torch.mm (oneDNN's GEMM where torch has it)"),
        Candidate("c", _compiled_rows(0), "pocketllm's compiled bf16 few-row GEMM (pocketllm/ops/gemv/gemv_bf16.c)"),
        Candidate("c-prefetch", _compiled_rows(PREFETCH_BYTES), "the same, each weight row prefetched non-temporally PREFETCH_BYTES ahead"),
        Candidate("amx", _amx_rows, "the same on AMX tiles, where the CPU has them"),
    )
}
FEW_ROW_DEFAULT = "mm"


def compiled_isa() -> str:
    """The instruction set the compiled kernel was built for, or why it was not."""
    lib, why = _compiled_library()
    return lib.gemv_bf16_isa().decode() if lib is not None else f"unavailable: {why}"


def candidates_for(rows: int) -> tuple[dict[str, Candidate], str]:
    """The kernels for passes of `rows` rows and the default among them."""
    return (CANDIDATES, DEFAULT) if rows == 1 else (FEW_ROW_CANDIDATES, FEW_ROW_DEFAULT)


def kernels_for(dtype: torch.dtype, device: torch.device, rows: int = 1) -> list[Candidate]:
    return [c for c in candidates_for(rows)[0].values() if not c.unavailable(dtype, device)]

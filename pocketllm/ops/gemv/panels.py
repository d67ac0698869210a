"""bf16 weights held in panels (panel_bf16.c): 64 rows at a time, input-major, so that one
output is one lane and every call sums it as one fp32 chain over its inputs in order. A
PanelWeight is the whole weight in that layout (the row-major tensor is not kept); its kernels
take the calls every projection makes: one row, a few rows, many rows.

Whether a run holds its bf16 weights so is measured at start (ops.registry.layout).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from pocketllm import compiled, host_memory
from pocketllm.ops.native_args import refuse

SOURCE = Path(__file__).with_name("panel_bf16.c")
PANEL = 64

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "panel_pack_bf16": (None, [_P, _P, _I, _I]),
    "panel_unpack_bf16": (None, [_P, _P, _I, _I]),
    "panel_gemv_bf16": (None, [_P, _P, _P] + [_I] * 4),
    "panel_gemm_bf16": (None, [_P, _P, _P] + [_I] * 5),
    "panel_bf16_isa": (ctypes.c_char_p, []),
}

_BF16 = torch.bfloat16


def _library() -> tuple[ctypes.CDLL | None, str]:
    return compiled.load(SOURCE, signatures=_SIGNATURES)


def unavailable(device: torch.device | str = "cpu") -> str:
    """Why weights cannot be held in panels here ("" when they can)."""
    if torch.device(device).type != "cpu":
        return "panels are a CPU layout"
    return compiled.unbuilt(_library(), "panel_bf16_isa")


def holds(w) -> bool:
    """Whether `w` is a weight panels can hold: a 2-D bfloat16 tensor on the CPU."""
    return isinstance(w, torch.Tensor) and w.dtype is _BF16 and w.dim() == 2 and w.is_cpu


@dataclass(frozen=True, eq=False)
class PanelWeight:
    """A bf16 weight [rows, n] in panels: `packed` holds ceil(rows / 64) * 64 * n values."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def dtype(self) -> torch.dtype:
        return _BF16

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes a product streams (the last panel's padding rows included)."""
        return self.packed.numel() * self.packed.element_size()

    def unpack(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as a row-major [rows, n] tensor (a copy), into `out` where given (bf16,
        contiguous, of the weight's shape)."""
        if out is None:
            out = torch.empty(self.shape, dtype=_BF16)
        elif out.shape != self.shape or out.dtype is not _BF16 or not out.is_contiguous() or not out.is_cpu:
            raise ValueError(f"unpack: out must be a contiguous bf16 CPU tensor of {tuple(self.shape)}, not {tuple(out.shape)} {out.dtype}")
        _library()[0].panel_unpack_bf16(self.packed.data_ptr(), out.data_ptr(), *self.shape)
        return out

    def rows(self, r0: int, r1: int) -> PanelWeight:
        """Output rows r0:r1 (a probe cut): whole panels where r0 falls on one, else repacked."""
        if r0 % PANEL == 0:
            n = self.in_features
            p1 = -(-r1 // PANEL)
            return PanelWeight(self.packed[r0 // PANEL * n * PANEL : p1 * n * PANEL], r1 - r0, n)
        return pack(self.unpack()[r0:r1])


def pack(w: torch.Tensor) -> PanelWeight:
    """A bf16 CPU weight [rows, n] in panels."""
    if not holds(w):
        raise ValueError(f"panels hold 2-D bfloat16 CPU weights, not {tuple(w.shape)} {w.dtype} on {w.device}")
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"panels: {why}")
    w = w.contiguous()
    rows, n = w.shape
    # On transparent huge pages, as the loaded weights are (pocketllm.host_memory): a product
    # streams the whole weight, and on 4 KiB pages it walked the page tables all the way (the
    # one-row pass up to a fifth slower); the pack's page faults are fewer too.
    packed = host_memory.zeros((-(-rows // PANEL) * PANEL * n,), _BF16)
    lib.panel_pack_bf16(w.data_ptr(), packed.data_ptr(), rows, n)
    return PanelWeight(packed, rows, n)


def _specs(x, w, out, m):
    n, o = (w.in_features, w.out_features) if isinstance(w, PanelWeight) else (None, None)
    return [("x", x, _BF16, None if n is None else m * n, False, None), ("out", out, _BF16, None if o is None else m * o, True, None)]


def _ok(x, w, out, m: int) -> bool:
    return (
        isinstance(w, PanelWeight) and x.dtype is _BF16 and out.dtype is _BF16 and x.numel() == m * w.in_features
        and out.numel() == m * w.out_features and out.is_contiguous() and x.is_cpu and out.is_cpu
    )


def _kernel(symbol: str, native_kind: str, a: int, b: int, one: bool):
    """A checked call of the compiled entry `symbol` with its two settings a, b: one row (x [in]
    or [1, in] -> out [out]) or m rows (x [m, in] -> out [m, out]); its `native` is the tuple
    compiled code calls it by (ops/fused/step_bf16.c): (native_kind, entry, weight, rows, n, a, b)."""

    def run(x: torch.Tensor, w: PanelWeight, out: torch.Tensor) -> None:
        m = 1 if one else (x.shape[0] if x.dim() == 2 else 0)
        if not _ok(x, w, out, m):
            refuse(symbol, _specs(x, w, out, m))
        if not x.is_contiguous():
            x = x.contiguous()
        args = (w.packed.data_ptr(), x.data_ptr(), out.data_ptr(), w.out_features, w.in_features) + ((a, b) if one else (m, a, b))
        getattr(_library()[0], symbol)(*args)

    def native(w: PanelWeight) -> tuple | None:
        lib = _library()[0]
        if lib is None:
            return None
        return native_kind, ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value, w.packed.data_ptr(), w.out_features, w.in_features, a, b

    run.native = native
    return run


def one_row(streams: int = 2, block: int = 32):
    """The one-row kernel on a PanelWeight: x [in] (or [1, in]) -> out [out], each thread's panels
    read as `streams` streams (1..4) a block of `block` inputs at a time."""
    return _kernel("panel_gemv_bf16", "bf16", streams, block, one=True)


def rows(mr: int, kb: int):
    """The kernel for x [m, in] -> out [m, out] on a PanelWeight, `mr` x rows by 16 weight rows
    at a time over blocks of `kb` inputs; each row the bits one_row gives it."""
    return _kernel("panel_gemm_bf16", "bf16-rows", mr, kb, one=False)


def unpacked(x: torch.Tensor, w: PanelWeight, out: torch.Tensor) -> None:
    """The weight unpacked to rows on every call, torch's matmul: the form any row count can run
    where no compiled one is chosen (a copy of the weight per call; never timed)."""
    out.copy_((x.float() @ w.unpack().float().t()).to(out.dtype))


def chain_reference(x: torch.Tensor, w: PanelWeight) -> torch.Tensor:
    """What every panel kernel must equal bit for bit (`unpacked` equals it up to fp32 summation
    order): each output summed as the kernels sum it: s = fma(w_k, x_k, s) for k in order from 0, in
    fp32, then rounded to bf16. In float64 each step's product and sum are exact before the one
    rounding to fp32 (a bf16 product has 16 significant bits, and the sum of two fp32 values fits
    in float64's 53), so rounding each step to fp32 is a fused multiply-add. Slow: for tests."""
    wf, xf = w.unpack().double(), x.double()
    s = torch.zeros(x.shape[0], w.out_features, dtype=torch.float64)
    for k in range(w.in_features):
        s = (s + xf[:, k : k + 1] * wf[:, k][None]).float().double()
    return s.float().to(_BF16)

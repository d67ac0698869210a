"""The GEMMs a projection of many rows (a prefill, a packed pass) may run: torch's own in the
weight's dtype, or the weight widened to fp32 a block of rows at a time into torch's fp32 GEMM.

torch's bf16/fp16 GEMM is fast where the CPU multiplies bf16 itself (AVX-512 BF16, AMX); where it
does not (an AVX2 CPU), the same call can run several times slower than the fp32 GEMM on the same
cores, and the fp32 GEMM on a widened copy is the faster way to the same fp32 sums; faster still,
the compiled GEMM of many_rows_bf16.c widens the weight as it packs it for its own fp32 tile
(c_f32). Which holds is measured by the kernel registry (pocketllm.ops.registry);
POCKETLLM_KERNELS=many-row=NAME forces one.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pocketllm import compiled
from pocketllm.ops.gemv.kernels import rows_ok, rows_specs
from pocketllm.ops.native_args import refuse

# Weight rows widened at a time: beyond a few hundred the fp32 GEMM gains nothing, and the block's
# fp32 copy stays small.
BLOCK_ROWS = 256


def gemm_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The plain form every kernel must equal (up to fp32 summation order): fp32 products and
    sums, rounded once to out's dtype."""
    out.copy_(x.float() @ w.float().t())


def mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(x, w.t(), out=out)


def mm_f32(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    xf = x.float()
    for o0 in range(0, w.shape[0], BLOCK_ROWS):
        o1 = min(o0 + BLOCK_ROWS, w.shape[0])
        out[:, o0:o1] = xf @ w[o0:o1].float().t()


SOURCE = Path(__file__).with_name("many_rows_bf16.c")
_SIGNATURES = {
    "gemm_bf16_f32": (ctypes.c_int, [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3),
    "gemm_f32_isa": (ctypes.c_char_p, []),
}


def _library() -> tuple[ctypes.CDLL | None, str]:
    return compiled.load(SOURCE, signatures=_SIGNATURES)


def c_f32_unavailable(fmt: str, device: torch.device) -> str:
    """Why c_f32 cannot run weights of `fmt` on `device` ("" when it can)."""
    if device.type != "cpu" or fmt != "bfloat16":
        return "the compiled fp32 GEMM takes bf16 weights on a CPU"
    return compiled.unbuilt(_library(), "gemm_f32_isa")


def c_f32(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ w^T for bf16 x [m, in], w [out, in], out [m, out]: fp32 products and sums, one
    chain per output in input order, each rounded once (many_rows_bf16.c)."""
    if not rows_ok(x, w, out):
        refuse("c-f32", rows_specs(x, w, out))
    if not x.is_contiguous():
        x = x.contiguous()
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"c-f32: {why}")
    rc = lib.gemm_bf16_f32(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], x.shape[0])
    if rc == -1:
        raise MemoryError(f"c-f32: no memory for x widened to fp32 ({x.shape[0]} x {x.shape[1]})")
    if rc != 0:
        raise RuntimeError(f"c-f32: {lib.gemm_f32_isa().decode()}")

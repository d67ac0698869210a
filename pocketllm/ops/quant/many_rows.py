"""Many-row (prefill) quantized projections through torch's GEMM: the weight dequantized a block of
rows at a time (compiled, dequant.c) into bf16 or fp32 and multiplied by torch's GEMM of that
dtype, so only one block is ever held unpacked.

bf16 rounds each dequantized weight once (the bf16 GEMM then sums in fp32): an error the
reference does not have, bounded by the tests. The fp32 block holds exactly the reference's
weights; it is for CPUs whose bf16 GEMM is slow (without AVX-512 BF16 or AMX; see
pocketllm/ops/many_rows.py).
"""

from __future__ import annotations

import torch

from pocketllm.ops.quant import native

# Weight rows dequantized at a time: as for the bf16 weights' widened GEMM, beyond a few hundred
# rows the GEMM gains nothing, and the block stays a few MiB.
BLOCK_ROWS = 256


def _dequant_mm(dtype: torch.dtype):
    label = f"dequant-{'bf16' if dtype == torch.bfloat16 else 'f32'}"

    def run(x: torch.Tensor, w, out: torch.Tensor) -> None:
        w = w if isinstance(w, native.CompiledWeight) else native.CompiledWeight(w, label)
        rows_x = native.check_io(label, x, w, out)
        x2, out2 = (x, out) if x.dim() == 2 else (x[None], out[None])
        xc = x2 if dtype == torch.bfloat16 else x2.float()
        block = torch.empty(min(BLOCK_ROWS, w.out_features), w.in_features, dtype=dtype)
        part = torch.empty(rows_x, block.shape[0], dtype=dtype)
        for o0 in range(0, w.out_features, BLOCK_ROWS):
            o1 = min(o0 + BLOCK_ROWS, w.out_features)
            blk = block[: o1 - o0]
            native.dequantize_rows(w, o0, o1, blk)
            if o1 - o0 == block.shape[0]:
                out2[:, o0:o1] = torch.mm(xc, blk.t(), out=part)
            else:  # the last, shorter block
                out2[:, o0:o1] = xc @ blk.t()

    return run


dequant_mm_bf16 = _dequant_mm(torch.bfloat16)
dequant_mm_f32 = _dequant_mm(torch.float32)

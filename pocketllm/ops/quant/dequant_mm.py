"""Many-row (prefill) quantized projections through torch's GEMM: the weight dequantized a block of
rows at a time (compiled, dequant.c) into bf16 or fp32 and multiplied by torch's GEMM of that
dtype, so only one block is ever held unpacked (native.blocked_product).

bf16 rounds each dequantized weight once (the bf16 GEMM then sums in fp32): an error the
reference does not have, bounded by the tests. The fp32 block holds exactly the reference's
weights; it is for CPUs whose bf16 GEMM is slow (without AVX-512 BF16 or AMX; see
pocketllm/ops/many_rows.py).
"""

from __future__ import annotations

import torch

from pocketllm.ops.quant import native


def _dequant_mm(dtype: torch.dtype):
    label = f"dequant-{'bf16' if dtype == torch.bfloat16 else 'f32'}"

    def run(x: torch.Tensor, w, out: torch.Tensor) -> None:
        if type(w) is not native.CompiledWeight:
            w = native.CompiledWeight(w, label)
        native.check_io(label, x, w, out)
        # bf16 blocks are for bf16 activations; others multiply fp32 blocks.
        native.blocked_product(x, w, out, dtype if x.dtype == torch.bfloat16 else torch.float32)

    return run


dequant_mm_bf16 = _dequant_mm(torch.bfloat16)
dequant_mm_f32 = _dequant_mm(torch.float32)

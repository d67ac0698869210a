"""Qwen's FP8 release format: `X.weight` float8 e4m3 [out, in] with `X.weight_scale_inv` fp32
[ceil(out / br), ceil(in / bc)], one per block of br x bc; a weight's value is the e4m3 value
times its block's scale. A slice of such a weight reads as fp32, so every float path (and
quantizing at load) takes it as it takes a bf16 one, reading only the blocks it covers."""

from __future__ import annotations

import torch


class Fp8Slice:
    """A safetensors slice of an e4m3 weight that yields its dequantized fp32 values for the
    index forms the loader uses: `[a:b]`, `[:, a:b]`, `[a:b, c:d]` and `[:]`."""

    # Scales of a weight quantized at load from this one: bf16, as the release's other weights.
    scale_dtype = torch.bfloat16

    def __init__(self, weight, scale, block: tuple[int, int]):
        self.weight, self.scale, self.block = weight, scale, block

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        out, cols = self.weight.get_shape()
        rows, cs = (index, slice(None)) if not isinstance(index, tuple) else (index + (slice(None),))[:2]
        r0, r1, _ = rows.indices(out)
        c0, c1, _ = cs.indices(cols)
        br, bc = self.block
        w = self.weight[r0:r1, c0:c1].float()
        s = self.scale[r0 // br : -(-r1 // br), c0 // bc : -(-c1 // bc)].float()
        s = s.repeat_interleave(br, dim=0)[r0 - r0 // br * br :][: r1 - r0]
        s = s.repeat_interleave(bc, dim=1)[:, c0 - c0 // bc * bc :][:, : c1 - c0]
        return w * s


E4M3_MAX = 448.0


def to_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 values [out, in], fp32 scales [ceil(out/br), ceil(in/bc)]) as the
    release quantizes: each block's largest magnitude maps to e4m3's largest, 448."""
    out, cols = w.shape
    br, bc = block
    wf = torch.nn.functional.pad(w.float(), (0, -cols % bc, 0, -out % br))
    blocks = wf.view(wf.shape[0] // br, br, wf.shape[1] // bc, bc)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(wf.shape)[:out, :cols].contiguous()
    return q, scale

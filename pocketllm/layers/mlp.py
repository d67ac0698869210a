"""SwiGLU MLP: gate and up as one column-parallel GEMM, down as the row-parallel `mlp.down` site."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm.config import ModelConfig
from pocketllm.distributed.state import tp
from pocketllm.layers.context import ForwardContext
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pocketllm.layers.sharding import split_range
from pocketllm.ops.fused import decode_ops
from pocketllm.ops.fused.reference import silu_mul_reference
from pocketllm.ops.row_blocks import by_row_blocks
from pocketllm.profiling.scopes import scope


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype, device):
        super().__init__()
        inter, hidden = cfg.intermediate_size, cfg.hidden_size
        rows = [split_range(inter, tp().rank, tp().world)]
        self.gate_up = ColumnParallelLinear(
            hidden,
            [(f"{prefix}.gate_proj.weight", (inter, hidden), rows), (f"{prefix}.up_proj.weight", (inter, hidden), rows)],
            dtype,
            device,
            cfg.weights,
        )
        self.down = RowParallelLinear(f"{prefix}.down_proj.weight", inter, hidden, "mlp.down", dtype, device, cfg.weights)
        self.decode_silu_mul = decode_ops(dtype, torch.device(device)).silu_mul

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        with scope("projections", "mlp.gate_up"):
            gate_up = self.gate_up(x)
        gate, up = gate_up.chunk(2, dim=-1)
        with scope("mlp_act"):
            act = self.decode_silu_mul(gate, up) if ctx.one_row else by_row_blocks(silu_mul_reference, gate, up)
        return self.down(act, ctx.slices)

"""SwiGLU MLP: gate and up as one column-parallel GEMM, down as the row-parallel `mlp.down` site."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm.config import ModelConfig
from pocketllm.distributed.state import tp
from pocketllm.layers.context import ForwardContext
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pocketllm.layers.sharding import split_range
from pocketllm.layers.row_forms import silu_mul_parts
from pocketllm.ops.fused import decode_ops
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
        self.decode_ops = decode_ops(dtype, torch.device(device))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        with scope("projections", "mlp.gate_up"):
            gate_up = self.gate_up(x, ctx)
        gate, up = gate_up.chunk(2, dim=-1)
        with scope("mlp_act"):
            act = silu_mul_parts(self.decode_ops, ctx.parts, gate, up)
        return self.down(act, ctx)

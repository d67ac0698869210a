"""The Qwen3.5/Qwen3.8 hybrid decoder (HF `qwen3_5_text`), built from TP layers: per layer a
token mixer (Gated DeltaNet or gated full attention) and a SwiGLU MLP, each behind a
zero-centred RMSNorm with a residual add; then the final norm and the vocab-parallel head."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm.config import FULL, ModelConfig
from pocketllm.layers.context import ForwardContext, Segment
from pocketllm.layers.attention import GatedAttention
from pocketllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pocketllm.layers.gdn import GatedDeltaNet
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pocketllm.layers.mlp import MLP
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.ops.fused import TORCH_OPS, decode_ops
from pocketllm.profiling.scopes import scope


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype, device):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.kind = cfg.layer_types[index]
        if self.kind == FULL:
            self.mixer = GatedAttention(cfg, f"{prefix}.self_attn", dtype, device)
        else:
            self.mixer = GatedDeltaNet(cfg, f"{prefix}.linear_attn", dtype, device)
        self.mlp = MLP(cfg, f"{prefix}.mlp", dtype, device)
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_norm = RMSNorm(f"{prefix}.input_layernorm.weight", h, eps, dtype, device)
        self.post_norm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", h, eps, dtype, device)
        self.decode_ops = decode_ops(dtype, torch.device(device))

    def forward(self, h: torch.Tensor, ctx: ForwardContext, state) -> torch.Tensor:
        ops = self.decode_ops if ctx.one_row else TORCH_OPS
        with scope("norms", "input"):
            x = ops.add_rms_norm(h, None, self.input_norm.scale, self.input_norm.eps)[1]
        x = self.mixer(x, ctx, state)
        with scope("norms", "resid_add"):
            h, x = ops.add_rms_norm(h, x, self.post_norm.scale, self.post_norm.eps)
        x = self.mlp(x, ctx)
        with scope("norms", "resid_add"):
            return h + x


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = VocabParallelEmbedding("model.embed_tokens.weight", cfg.vocab_size, h, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm("model.norm.weight", h, cfg.rms_norm_eps, dtype, device)
        tied = self.embed if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead("lm_head.weight", cfg.vocab_size, h, dtype, device, tied_to=tied, plan=cfg.weights)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, device)
        self.decode_ops = decode_ops(dtype, torch.device(device))

    def projections(self) -> list[nn.Module]:
        """Every layer that runs one weight through bound kernels (`.weight`, `.kernels`), in the
        order a step reads them: the projections layer by layer (a fused projection held as
        blocks, each block), then the head."""
        linear = (ColumnParallelLinear, RowParallelLinear)
        return [m for m in self.modules() if isinstance(m, linear) and m.blocks is None] + [self.lm_head]

    def projection_weights(self) -> list:
        return [m.weight for m in self.projections()]

    def bind_kernels(self, kernels) -> None:
        """Bind every projection to its kernels in `kernels` (a registry KernelSet)."""
        for m in self.projections():
            m.kernels = kernels.bind(m.weight)

    def context(self, spans: list[tuple[int, int]], slices: int) -> ForwardContext:
        """The context of a pass packing its sequences' rows one after another: spans are (start
        position, rows) per sequence."""
        segments, row0 = [], 0
        for start, rows in spans:
            cos, sin = self.rotary.cos_sin(start, rows)
            segments.append(Segment(row0, start, rows, cos, sin))
            row0 += rows
        return ForwardContext(slices, tuple(segments), row0)

    def forward(self, ids: torch.Tensor, ctx: ForwardContext, states: list, all_logits: bool = False) -> torch.Tensor:
        """ids [T] -> fp32 logits of each sequence's last row [S, V], or of every row [T, V] when
        asked. states holds one state list (one state per layer) per sequence of ctx."""
        last = [s.row0 + s.rows - 1 for s in ctx.segments]
        # STACK is the whole pass, embedding to logits: the profile's shares are fractions of it.
        with scope("STACK"):
            with scope("embed"):
                h = self.embed(ids)
            for i, layer in enumerate(self.layers):
                h = layer(h, ctx, [seq[i] for seq in states])
            if not all_logits:
                # One sequence's last row as a view; several gathered.
                h = h[last[0] : last[0] + 1] if len(last) == 1 else h[last]
            with scope("norms", "final"):
                # A decode row's final norm is the compiled one the layers' norms use (torch's,
                # right after the last GEMV streamed its weight, took several times as long).
                h = self.decode_ops.add_rms_norm(h, None, self.norm.scale, self.norm.eps)[1] if ctx.one_row else self.norm(h)
            with scope("lm_head"):
                logits = self.lm_head(h)
                if all_logits and h.shape[0] > len(last):
                    # The last rows again through the head of last rows only (a GEMV for one,
                    # where all rows went through a GEMM that rounds differently), so a token
                    # drawn from them is the one a last-rows-only pass would draw.
                    logits[last] = self.lm_head(h[last])
        return logits

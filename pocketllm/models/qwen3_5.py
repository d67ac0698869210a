"""The Qwen3.5/Qwen3.8 hybrid decoder (HF `qwen3_5_text`), built from TP layers: per layer a
token mixer (Gated DeltaNet or gated full attention) and a SwiGLU MLP, each behind a
zero-centred RMSNorm with a residual add; then the final norm and the vocab-parallel head."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm import host_memory
from pocketllm.config import FULL, ModelConfig
from pocketllm.device import to_device
from pocketllm.layers import row_forms
from pocketllm.layers.context import CPU_PASS, ForwardContext, Part, PassShape, Segment, part_forms_on_cpu, parts_of
from pocketllm.layers.attention import GatedAttention
from pocketllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pocketllm.layers.gdn import GatedDeltaNet
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pocketllm.layers.mlp import MLP
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.ops.fused import decode_ops
from pocketllm.ops.gemv import panels
from pocketllm.ops.registry import default_kernels
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

    def forward(self, h: torch.Tensor, x: torch.Tensor | None, ctx: ForwardContext, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream arrives as h + x (x None: h alone) and leaves the same way, the MLP's
        output not yet added: each add happens inside the next norm's call (one compiled call per
        decode row, where a separate add is a torch op after a GEMV; the bits are the same)."""
        ops, parts = self.decode_ops, ctx.parts
        with scope("norms", "input"):
            h, x = row_forms.add_rms_norm_parts(ops, parts, h, x, self.input_norm.scale, self.input_norm.eps)
        x = self.mixer(x, ctx, state)
        with scope("norms", "resid_add"):
            h, x = row_forms.add_rms_norm_parts(ops, parts, h, x, self.post_norm.scale, self.post_norm.eps)
        return h, self.mlp(x, ctx)


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

    @property
    def gdn_kernel(self):
        """The gated-delta-rule kernel the GDN layers run (one per process), None without any."""
        return next((layer.mixer.kernel for layer in self.layers if layer.kind != FULL), None)

    def projection_weights(self) -> list:
        return [m.weight for m in self.projections()]

    def hold_in_panels(self) -> int:
        """Every bf16 CPU projection weight replaced by the same weight in panels
        (ops.gemv.panels), one at a time, the row-major tensor let go; a head tied to the
        embedding keeps the embedding's. Returns how many were."""
        count = 0
        for m in self.projections():
            w = m.weight
            if not panels.holds(w) or w is self.embed.weight:
                continue
            packed = panels.pack(w.detach())
            del m.weight
            m.weight = packed
            m.kernels = default_kernels(packed)
            count += 1
        return count

    def hold_as_loaded(self) -> int:
        """hold_in_panels undone: every weight in panels back to a row-major parameter. Returns
        how many were."""
        count = 0
        for m in self.projections():
            if isinstance(m.weight, panels.PanelWeight):
                # Back on huge pages, as loaded (pocketllm.host_memory).
                w = m.weight.unpack(host_memory.zeros(m.weight.shape, torch.bfloat16))
                del m.weight
                m.weight = nn.Parameter(w, requires_grad=False)
                m.kernels = default_kernels(m.weight)
                count += 1
        return count

    def bind_kernels(self, kernels) -> None:
        """Bind every projection to its kernels in `kernels` (a registry KernelSet)."""
        for m in self.projections():
            m.kernels = kernels.bind(m.weight)

    def context(self, spans: list[tuple[int, int]], slices: int, last: tuple[int, ...], invariant: bool, slices_for, shape: PassShape = CPU_PASS) -> ForwardContext:
        """The context of a pass packing its segments' rows one after another: spans are (start
        position, rows) per segment (a sequence's rows may be several consecutive segments);
        `last`: the row each of the caller's spans ends on.
        invariant: every prompt segment's rows in calls of their own, sliced by
        `slices_for(rows)`, and the single rows together, each as it is alone (context.parts_of).
        shape: the forms the row-wise work takes (PassShape.cpu_forms)."""
        segments, row0 = [], 0
        for start, rows in spans:
            cos, sin = self.rotary.cos_sin(start, rows)
            segments.append(Segment(row0, start, rows, cos, sin, shape.cpu_forms))
            row0 += rows
        segments = tuple(segments)
        parts = parts_of(segments, row0, slices, invariant, slices_for, part_forms_on_cpu(shape, invariant, self.decode_ops.device.kernels))
        return ForwardContext(slices, segments, row0, parts, tuple(last), invariant, shape=shape)

    def forward(self, ids: torch.Tensor, ctx: ForwardContext, states: list, all_logits: bool = False) -> torch.Tensor:
        """ids [T] -> fp32 logits of each span's last row [S, V] (ctx.last), or of every row
        [T, V] when asked. states holds one state list (one state per layer) per segment of ctx."""
        last = list(ctx.last)
        # STACK is the whole pass, embedding to logits: the profile's shares are fractions of it.
        with scope("STACK"):
            with scope("embed"):
                h, x = self.embed(ids), None
            for i, layer in enumerate(self.layers):
                h, x = layer(h, x, ctx, [seq[i] for seq in states])
            # Consecutive last rows (one sequence's, or every row of a pass of decode rows) as a
            # view; others gathered. The last layer's residual add is the final norm's.
            consecutive = last == list(range(last[0], last[0] + len(last)))
            pick = slice(last[0], last[-1] + 1) if consecutive else to_device(torch.tensor(last), h.device)
            rows, rows_x = h[pick], x[pick]
            # The last rows are each their sequence's own: each gets the bits it gets alone (and a
            # decode row the compiled final norm the layers' norms use, which finds the row where
            # torch's would fetch its own state again after the last GEMV swept the caches).
            # On a device asked for invariance a pass of prompts gives them a part each: its
            # kernels sum a row by the call's rows, and how many prompts end in a pass is the
            # load's (a step's rows are its fixed count, in one call).
            if not (ctx.invariant or ctx.one_row):
                alone = None
            elif ctx.shape.fixed_step and ctx.decode_rows is None:
                alone = tuple(Part(i, i + 1, True, cpu_forms=False) for i in range(len(last)))
            else:
                alone = (Part(0, len(last), True, cpu_forms=ctx.shape.cpu_forms),)
            with scope("norms", "final"):
                rows = self._final_norm(rows, rows_x, alone, ctx.shape.cpu_forms)
            with scope("lm_head"):
                logits = self.lm_head(rows, alone)
                if all_logits:
                    # Every row through the head by the pass's parts; the last rows are the ones
                    # above (a GEMV for one, where a GEMM rounds differently), so a token drawn
                    # from them is the one a last-rows-only pass would draw.
                    every = self.lm_head(self._final_norm(h, x, ctx.parts), ctx.parts)
                    every[last] = logits
                    logits = every
        return logits

    def _final_norm(self, h: torch.Tensor, x: torch.Tensor, parts, cpu_forms: bool = True) -> torch.Tensor:
        """The final norm of the residual stream h + x (by parts: as they say)."""
        if parts is None:
            if not cpu_forms:
                return self.decode_ops.device.add_rms_norm(h, x, self.norm.scale, self.norm.eps)[1]
            return self.norm(h + x)
        return row_forms.add_rms_norm_parts(self.decode_ops, parts, h, x, self.norm.scale, self.norm.eps)[1]

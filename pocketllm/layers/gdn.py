"""Gated DeltaNet linear attention, split over ranks by heads: the four in-projections as one
column-parallel GEMM, the depthwise causal conv per q/k/v segment, the gated delta rule, the gated
RMSNorm and the row-parallel `lin.out` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.config import ModelConfig
from pocketllm.distributed.state import tp
from pocketllm.layers.cache import GDNState, GDNStates
from pocketllm.layers.context import DecodeRows, ForwardContext, Segment, per_sequence
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pocketllm.layers.norm import GatedRMSNorm
from pocketllm.layers.sharding import ShardSource, read_rows, sharded_param, split_range
from pocketllm.ops.causal_conv import causal_conv1d_prefill_, causal_conv1d_rows_indexed_, causal_conv1d_step_
from pocketllm.ops.fused import decode_ops
from pocketllm.ops.fused import kernels as fused_kernels
from pocketllm.ops.gated_delta import gated_delta_step_torch_, select_gdn_kernel
from pocketllm.ops.norms import l2_normalize
from pocketllm.profiling.scopes import scope

# HF's l2norm epsilon for q and k.
L2_EPS = 1e-6


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype, device):
        super().__init__()
        rank, world = tp().rank, tp().world
        hidden = cfg.hidden_size
        self.hk = cfg.linear_num_key_heads // world
        self.hv = cfg.linear_num_value_heads // world
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        # This rank's channels of each conv segment [q | k | v] of the full qkv projection.
        q0, q1 = split_range(key_dim, rank, world)
        v0, v1 = split_range(value_dim, rank, world)
        qkv_ranges = [(q0, q1), (key_dim + q0, key_dim + q1), (2 * key_dim + v0, 2 * key_dim + v1)]
        heads = [split_range(cfg.linear_num_value_heads, rank, world)]
        self.in_proj = ColumnParallelLinear(
            hidden,
            [
                (f"{prefix}.in_proj_qkv.weight", (cfg.conv_dim, hidden), qkv_ranges),
                (f"{prefix}.in_proj_z.weight", (value_dim, hidden), [(v0, v1)]),
                (f"{prefix}.in_proj_b.weight", (cfg.linear_num_value_heads, hidden), heads),
                (f"{prefix}.in_proj_a.weight", (cfg.linear_num_value_heads, hidden), heads),
            ],
            dtype,
            device,
            cfg.weights,
        )
        kernel = cfg.linear_conv_kernel_dim
        self.conv_channels = self.in_proj.part_sizes[0]
        conv_src = ShardSource(f"{prefix}.conv1d.weight", (cfg.conv_dim, 1, kernel), read_rows(qkv_ranges))
        self.conv_weight = sharded_param((self.conv_channels, 1, kernel), [conv_src], dtype, device)
        head_src = lambda name: ShardSource(f"{prefix}.{name}", (cfg.linear_num_value_heads,), read_rows(heads))  # noqa: E731
        self.A_log = sharded_param((self.hv,), [head_src("A_log")], dtype, device)
        self.dt_bias = sharded_param((self.hv,), [head_src("dt_bias")], dtype, device)
        self.norm = GatedRMSNorm(f"{prefix}.norm.weight", self.dv, cfg.rms_norm_eps, dtype, device)
        self.out_proj = RowParallelLinear(f"{prefix}.out_proj.weight", value_dim, hidden, "lin.out", dtype, device, cfg.weights)
        # Probed at this layer's heads: the layout its kernels are compiled (and tuned) for anyway.
        self.kernel = select_gdn_kernel(device, dtype, layout=(self.hk, self.hv, self.dk, self.dv))
        # The compiled decode block replaces only the CPU torch recurrence, not a device kernel.
        ops = decode_ops(dtype, torch.device(device))
        self.compiled_decode = ops.gdn_decode if self.kernel.decode_step_ is gated_delta_step_torch_ else None
        self.compiled_decode_rows = ops.gdn_decode_rows if self.compiled_decode is not None else None
        # ops.device: what a device's pass shape runs between the projections (Triton kernels on
        # CUDA), read at each call as the norms and SiLU-and-multiply around the mixers read it.
        self.decode_ops = ops
        self._dtype, self._device = dtype, device
        self.neg_a: torch.Tensor | None = None
        self.conv_taps: torch.Tensor | None = None

    def after_loading(self) -> None:
        # Neither changes after loading: -exp(A_log) in fp32 (HF's decay rate) and the conv
        # weight as fp32 taps [K, C], the form both conv paths read.
        self.neg_a = -torch.exp(self.A_log.float())
        self.conv_taps = self.conv_weight[:, 0, :].t().float().contiguous()

    def allocate_states(self, count: int) -> GDNStates:
        """The state of `count` slots, stacked."""
        k = self.conv_weight.shape[-1]
        return GDNStates(
            conv=torch.zeros(count, k - 1, self.conv_channels, dtype=self._dtype, device=self._device),
            recurrent=torch.zeros(count, self.hv, self.dk, self.dv, dtype=torch.float32, device=self._device),
        )

    def state_bytes(self) -> int:
        """What one slot's state takes."""
        conv = (self.conv_weight.shape[-1] - 1) * self.conv_channels * self.conv_weight.element_size()
        return conv + self.hv * self.dk * self.dv * 4

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `state` holds this layer's GDNState of each sequence of
        the pass (ctx.segments)."""
        with scope("projections", "lin.in"):
            proj = self.in_proj(x, ctx)
        if ctx.decode_rows is not None:
            return self.out_proj(self._mix_rows(proj, ctx.decode_rows, state[0], ctx.shape.cpu_forms), ctx)
        return self.out_proj(self._mix_segments(proj, ctx, state), ctx)

    def _mix_segments(self, proj: torch.Tensor, ctx: ForwardContext, state: list) -> torch.Tensor:
        """per_sequence's _mix, except that each run of consecutive decode rows of distinct
        sequences goes through the compiled block in one call (gdn_decode_rows: each row the bits
        it gets alone), where the block is compiled: one call and one split of the heads over the
        threads per layer instead of one per sequence."""
        if self.compiled_decode_rows is None or len(ctx.segments) == 1:
            return per_sequence(self._mix, proj, ctx, state)
        outs: list[torch.Tensor] = []
        run: list[tuple[Segment, GDNState]] = []
        in_run: set[int] = set()  # the run's states, by identity

        def close_run() -> None:
            if len(run) == 1:
                outs.append(self._mix(proj[run[0][0].row0 : run[0][0].row0 + 1], *run[0]))
            elif run:
                row0 = run[0][0].row0
                with scope("gdn_decode"):
                    outs.append(self.compiled_decode_rows(
                        proj[row0 : row0 + len(run)], self.conv_taps, [st.conv for _, st in run], self.neg_a, self.dt_bias,
                        self.norm.weight, self.norm.eps, [st.recurrent for _, st in run], self.hk, self.hv, self.dk, self.dv,
                    ))
            run.clear()
            in_run.clear()

        for seg, st in zip(ctx.segments, state):
            joins = seg.one_row and seg.rows == 1 and seg.cpu_forms
            # A sequence's consecutive rows (a replay of its decode rows) share its state: each
            # must see the step before it, so the run ends before the second.
            if not joins or id(st) in in_run:
                close_run()
            if joins:
                run.append((seg, st))
                in_run.add(id(st))
            else:
                outs.append(self._mix(proj[seg.row0 : seg.row0 + seg.rows], seg, st))
        close_run()
        return torch.cat(outs)

    def _mix_rows(self, proj: torch.Tensor, rows: DecodeRows, states: GDNStates, cpu_forms: bool) -> torch.Tensor:
        """A decode row of each of B sequences [B, in_local] -> [B, hv*dv], each sequence's state
        its slot's row of `states`: the conv window and the recurrent state advanced where they
        are (on CUDA in place by one kernel each, else gathered, advanced and put back).
        The rows _mix takes one by one through its torch path, in one call of each op, the same
        ops on each row."""
        mixed, z, b, a = proj.split(self.in_proj.part_sizes, dim=-1)
        with scope("gdn_conv"):
            if cpu_forms:
                mixed = causal_conv1d_rows_indexed_(mixed, self.conv_taps, states.conv, rows.slots)
            else:
                # A device's step: one kernel (Triton on CUDA) advancing each window where it lies.
                mixed = self.decode_ops.device.causal_conv1d_rows_indexed_(mixed, self.conv_taps, states.conv, rows.slots)
        q, k, v, g, beta = self._heads_and_gates(mixed, b, a, cpu_forms)
        with scope("gated_delta"):
            out = self.kernel.decode_rows_indexed_(q, k, v, g, beta, states.recurrent, rows.slots)
        with scope("norms", "gated"):
            out = self._gated_norm(out.to(proj.dtype), z.view(z.shape[0], self.hv, self.dv), cpu_forms)
        return out.reshape(z.shape[0], self.hv * self.dv)

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor, cpu_forms: bool) -> torch.Tensor:
        if cpu_forms:
            return self.norm(out, z)
        return self.decode_ops.device.rms_norm_gated(out, z, self.norm.weight, self.norm.eps)

    def _heads_and_gates(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, cpu_forms: bool):
        """The conv's output rows [T, conv channels] and the gate inputs -> q, k [T, hk, dk] l2-
        normalised (q scaled by dk**-0.5), v [T, hv, dv], the log decay g and beta [T, hv] fp32."""
        t, kd = mixed.shape[0], self.hk * self.dk
        qk, v = mixed.split((2 * kd, self.hv * self.dv), dim=-1)
        qk = qk.view(t, 2 * self.hk, self.dk)
        if not cpu_forms:
            with scope("norms", "lin.qk_l2"):
                q, k = self.decode_ops.device.qk_l2_norm(qk, self.hk, self.dk**-0.5, L2_EPS)
            with scope("gates", "lin"):
                g, beta = self.decode_ops.device.gdn_gates(a, b, self.neg_a, self.dt_bias)
            return q, k, v.view(t, self.hv, self.dv), g, beta
        with scope("norms", "lin.qk_l2"):
            # q and k are adjacent channels: one normalisation over both halves the op count.
            qk = l2_normalize(qk, L2_EPS)
            q, k = qk[:, : self.hk] * self.dk**-0.5, qk[:, self.hk :]
        with scope("gates", "lin"):
            beta = torch.sigmoid(b).float()
            g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        return q, k, v.view(t, self.hv, self.dv), g, beta

    def _mix(self, proj: torch.Tensor, seq: Segment, state: GDNState) -> torch.Tensor:
        """One sequence's projected rows [T, in_local] -> the gated norm's output [T, hv*dv],
        advancing its conv and recurrent state."""
        t = proj.shape[0]
        if seq.one_row and self.compiled_decode is not None:
            # One call from the conv to the gated norm; the same as the path below (the tests
            # compare them) up to fp32 summation order.
            with scope("gdn_decode"):
                return self.compiled_decode(
                    proj, self.conv_taps, state.conv, self.neg_a, self.dt_bias, self.norm.weight, self.norm.eps,
                    state.recurrent, self.hk, self.hv, self.dk, self.dv,
                )
        mixed, z, b, a = proj.split(self.in_proj.part_sizes, dim=-1)
        # A prompt segment's conv and gated norm take the compiled rows forms where the decode
        # block is compiled (bf16 on a CPU): the same roundings, split over the threads.
        rows_compiled = self.compiled_decode is not None and not seq.one_row and seq.cpu_forms
        with scope("gdn_conv"):
            if seq.one_row:
                mixed = causal_conv1d_step_(mixed, self.conv_taps, state.conv)
            elif rows_compiled:
                mixed = fused_kernels.conv_silu_rows(mixed, self.conv_taps, state.conv)
            elif seq.cpu_forms:
                mixed = causal_conv1d_prefill_(mixed, self.conv_taps, state.conv)
            else:
                mixed = self.decode_ops.device.causal_conv1d_prefill_(mixed, self.conv_taps, state.conv)
        q, k, v, g, beta = self._heads_and_gates(mixed, b, a, seq.cpu_forms)
        # The recurrence itself, whichever kernel runs it.
        with scope("gated_delta"):
            if seq.one_row:
                out = self.kernel.decode_step_(q, k, v, g, beta, state.recurrent)
            else:
                out, final = self.kernel.prefill(q, k, v, g, beta, state.recurrent)
                state.recurrent.copy_(final)
        with scope("norms", "gated"):
            if rows_compiled:
                out = fused_kernels.rms_norm_gated_rows(out.to(proj.dtype).contiguous(), z.view(t, self.hv, self.dv), self.norm.weight, self.norm.eps)
            else:
                out = self._gated_norm(out.to(proj.dtype), z.view(t, self.hv, self.dv), seq.cpu_forms)
        return out.reshape(t, self.hv * self.dv)

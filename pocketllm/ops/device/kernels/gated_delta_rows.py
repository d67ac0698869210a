"""The gated delta rule's decode step of B sequences with each sequence's state read and written in
place at its slot's row of the layer's stacked state
(ops/gated_delta/indexed.gated_delta_rows_indexed_torch_'s contract). The torch form gathers the
B states (a copy), advances the copy and puts it back (another): each state is read and written
three times where this kernel reads and writes it once.

One program per (sequence, value head, block of BV value columns): it loads its [Dk, BV] tile of
the old state once, and in fp32 computes what gated_delta_rows_torch_ does, in its order:
k^T S and q^T S from the old tile, delta = (v - decay k^T S) beta, out = decay q^T S + (q . k)
delta, and the new tile decay S + k (x) delta, stored over the old. A column of the state needs
only its own column of the old state, so the programs of a head share nothing. Value head h reads
key head h // (Hv // Hk).

Rows may repeat a slot only where its result does not matter (the padding slot of a captured
step's spare rows): their programs then race on its tiles."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import launch_options

# Value columns a program, and its warps: a [Dk, BV] fp32 tile (16 KiB at Dk 128) over 128 threads,
# Hv * Dv / BV programs a sequence (192 for the 27B's 48 heads of 128). What recent copies of fla's
# fused recurrent kernel take for a decode step (vLLM's went from 8 to 32 columns); not measured here.
BV = 32
NUM_WARPS = 4


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr,
            q_row, q_head, k_row, k_head, v_row, v_head, g_row, beta_row, slots_step,
            HV, GROUPS, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    kh = h // GROUPS
    ks = tl.arange(0, BK).to(tl.int64)
    vs = tl.program_id(1).to(tl.int64) * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < DK, vs < DV
    q = tl.load(q_ptr + b * q_row + kh * q_head + ks, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * k_row + kh * k_head + ks, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * v_row + h * v_head + vs, mask=v_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * g_row + h).to(tl.float32))
    beta = tl.load(beta_ptr + b * beta_row + h).to(tl.float32)
    slot = tl.load(slots_ptr + b * slots_step).to(tl.int64)
    tile = state_ptr + ((slot * HV + h) * DK + ks[:, None]) * DV + vs[None, :]  # [BK, BV]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(tile, mask=tile_ok, other=0.0)
    k_s = tl.sum(k[:, None] * s, axis=0)  # [BV]
    q_s = tl.sum(q[:, None] * s, axis=0)
    delta = (v - decay * k_s) * beta
    out = decay * q_s + tl.sum(q * k, axis=0) * delta
    tl.store(out_ptr + bh * DV + vs, out, mask=v_ok)
    tl.store(tile, s * decay + k[:, None] * delta[None, :], mask=tile_ok)


def gated_delta_rows_indexed_(q, k, v, g, beta, state, slots) -> torch.Tensor:
    """q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] (any dtype, widened to fp32; last dims
    contiguous, rows and heads at any stride), state [S, Hv, Dk, Dv] fp32 contiguous, advanced in
    place at rows slots [B] (integers). Returns out [B, Hv, Dv] fp32, new and contiguous."""
    b, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != b or tuple(g.shape) != (b, hv) or tuple(beta.shape) != (b, hv) or hv % hk:
        raise ValueError(f"q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] with Hk dividing Hv; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be [S, Hv={hv}, Dk={dk}, Dv={dv}] fp32 contiguous; got {tuple(state.shape)} {state.dtype}")
    if tuple(slots.shape) != (b,) or slots.is_floating_point():
        raise ValueError(f"slots must be [B={b}] integers; got {tuple(slots.shape)} {slots.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, beta)):
        raise ValueError("q, k, v, g and beta need their last dim contiguous")
    out = torch.empty(b, hv, dv, dtype=torch.float32, device=v.device)
    if b:
        bk, bv = triton.next_power_of_2(dk), min(BV, triton.next_power_of_2(dv))
        _kernel[(b * hv, triton.cdiv(dv, bv))](
            q, k, v, g, beta, state, slots, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), slots.stride(0),
            hv, hv // hk, dk, dv, BK=bk, BV=bv, **(launch_options(bk * bv) | {"num_warps": NUM_WARPS}),
        )
    return out

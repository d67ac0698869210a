"""Which gated-delta-rule kernel runs: the one seam where device kernels plug in.

The choice is made from (device, dtype, POCKETLLM_GDN_KERNEL) and what is installed, before any rank
starts (pocketllm/ops/gdn_choice.py, pure and torch-free, so every combination is tested on CPU
and the launcher plans it without torch); each rank then probes a
device kernel once with a tiny call against the torch per-token forms before trusting it
(select_gdn_kernel). Unforced: fla on cuda for bf16/fp16, the CANN op on npu for bf16, else the
torch chunked kernel, which works everywhere. POCKETLLM_GDN_KERNEL=chunk|recurrent|fla|npu (or
the seed's QWEN_GDN_KERNEL) forces one ('recurrent' runs the per-token loop for prefill too: the
seed's ablation); a forced kernel this machine cannot run is a usage error. Decode never takes a chunked path.

On CUDA a decode step of several sequences runs the Triton kernel that advances each sequence's
state in place at its slot's row of the stacked state (ops/gated_delta/indexed.py), whichever
kernel runs prefill, once it passes its own probe (with_triton_decode_rows).

The fla and npu adapters are contract-tested on CPU against stand-ins bound to those libraries'
signatures (tests/test_gdn_kernels.py); they have not yet run on a device.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from pocketllm.ops.gdn_choice import ENV, GdnKernelError, KernelChoice, dtype_name, plan_gdn_kernel
from pocketllm.switches import env_setting
from pocketllm.ops.device import triton_missing
from pocketllm.ops.gated_delta import fla_adapter, npu_adapter
from pocketllm.ops.gated_delta.chunked import gated_delta_rule_chunked
from pocketllm.ops.gated_delta.indexed import gated_delta_rows_indexed_op, gated_delta_rows_indexed_torch_, gathered
from pocketllm.ops.gated_delta.recurrent import gated_delta_rows_torch_, gated_delta_rule_recurrent, gated_delta_step_torch_

# The probe's tokens, and its heads and head dims (key heads, value heads, key dim, value dim)
# where the caller names none: the 27B's head dims and its 3 value heads per key head (48 / 16).
# A layer probes at its own: a device kernel compiles (and fla autotunes) once per head layout,
# so a probe at another layout would cost a first start a second compile.
PROBE_TOKENS = 8
PROBE_LAYOUT = (2, 6, 128, 128)
# Worst relative error (max |diff| / max |ref|) a probe accepts, by the dtype the kernel ran in.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class GdnKernel:
    """prefill(q, k, v, g, beta, initial_state) -> (out [T, Hv, Dv], final_state [Hv, Dk, Dv] fp32);
    decode_step_(q, k, v, g, beta, state) -> out [1, Hv, Dv] (fp32 or v's dtype; the layer rounds
    it to its own), advancing `state` in place; decode_rows_indexed_(q, k, v, g, beta, state,
    slots) the same for one token of each of B sequences (q, k [B, Hk, Dk]) on the layer's stacked
    state [S, Hv, Dk, Dv], each sequence's state at its slot's row advanced
    (ops/gated_delta/indexed.py), what a decode step of several sequences runs: on CUDA the Triton
    kernel that reads and writes the rows in place, else a rows form on the gathered rows."""

    name: str
    reason: str
    prefill: Callable
    decode_step_: Callable
    decode_rows_indexed_: Callable = gated_delta_rows_indexed_torch_

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def probe_inputs(device, dtype, layout=PROBE_LAYOUT, seed: int = 0, tokens: int = PROBE_TOKENS):
    """Small inputs like a layer's of `layout` (Hk, Hv, Dk, Dv): q, k l2-normalised (q scaled),
    g <= 0, beta in (0, 1)."""
    T, (Hk, Hv, Dk, Dv) = tokens, layout
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1) * Dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1)
    v = torch.randn(T, Hv, Dv, generator=gen)
    g = -torch.rand(T, Hv, generator=gen)
    beta = torch.rand(T, Hv, generator=gen)
    state = torch.randn(Hv, Dk, Dv, generator=gen) * 0.1
    put = lambda x, dt: x.to(device=device, dtype=dt)  # noqa: E731
    return put(q, torch.float32), put(k, torch.float32), put(v, dtype), put(g, torch.float32), put(beta, torch.float32), put(state, torch.float32)


def _worst(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _first_line(exc: Exception) -> str:
    """An exception as its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")


def probe(prefill, decode_step_, device, dtype, decode_rows_=gated_delta_rows_torch_, layout=PROBE_LAYOUT) -> str | None:
    """Run a kernel once on a tiny input of `layout` on `device` against the torch per-token
    forms; None when it agrees, else why not (its exception's last line, or how far off it was)."""
    q, k, v, g, beta, state = probe_inputs(device, dtype, layout)
    tol = PROBE_TOLERANCE[dtype]
    try:
        out, final = prefill(q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1], state)
        ref_out, ref_final = gated_delta_rule_recurrent(q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1], state)
        errors = {"prefill out": _worst(out, ref_out), "prefill state": _worst(final, ref_final)}
        if decode_step_ is not gated_delta_step_torch_:
            mine, ref = ref_final.clone(), ref_final.clone()
            step = decode_step_(q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], mine)
            ref_step = gated_delta_step_torch_(q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], ref)
            errors |= {"decode out": _worst(step, ref_step), "decode state": _worst(mine, ref)}
        if decode_rows_ is not gated_delta_rows_torch_:
            # Two sequences' last tokens as one call, each from its own state.
            rows = lambda x: torch.stack((x[-1], x[-2]))  # noqa: E731
            mine = torch.stack((ref_final, state)).contiguous()
            ref = mine.clone()
            step = decode_rows_(rows(q), rows(k), rows(v), rows(g), rows(beta), mine)
            ref_step = gated_delta_rows_torch_(rows(q), rows(k), rows(v), rows(g), rows(beta), ref)
            errors |= {"decode rows out": _worst(step, ref_step), "decode rows state": _worst(mine, ref)}
    except Exception as exc:  # the probe's purpose: any failure means "do not trust it"
        return _first_line(exc)
    bad = {name: e for name, e in errors.items() if not e <= tol}
    if bad:
        return "disagrees with the reference: " + ", ".join(f"{n} {e:.1e}" for n, e in bad.items()) + f" (tolerance {tol:.0e})"
    return None


def probe_indexed(decode_rows_indexed_, device, dtype, layout=PROBE_LAYOUT) -> str | None:
    """Run a decode_rows_indexed_ once on `device` against the torch form: three sequences' rows
    at slots out of order in a stack of four, the fourth left as it was bit for bit. None when it
    agrees, else why not."""
    try:
        q, k, v, g, beta, state = probe_inputs(device, dtype, layout)
        mine = torch.stack([state * scale for scale in (1.0, -0.5, 0.25, 2.0)])
        ref, slots = mine.clone(), torch.tensor([2, 0, 3], device=device)
        out = decode_rows_indexed_(q[:3], k[:3], v[:3], g[:3], beta[:3], mine, slots)
        ref_out = gated_delta_rows_indexed_torch_(q[:3], k[:3], v[:3], g[:3], beta[:3], ref, slots)
        errors = {"decode rows out": _worst(out, ref_out), "decode rows state": _worst(mine, ref)}
        if not torch.equal(mine[1], ref[1]):
            return "changed a slot outside the step's rows"
    except Exception as exc:  # any failure means "do not trust it"
        return _first_line(exc)
    tol = PROBE_TOLERANCE[torch.float32]
    bad = {name: e for name, e in errors.items() if not e <= tol}
    if bad:
        return "disagrees with the reference: " + ", ".join(f"{n} {e:.1e}" for n, e in bad.items()) + f" (tolerance {tol:.0e})"
    return None


def with_triton_decode_rows(kernel: GdnKernel, device, dtype, op=gated_delta_rows_indexed_op, layout=PROBE_LAYOUT) -> GdnKernel:
    """`kernel` with the Triton decode of several sequences on the stacked state in place (the
    custom op `op`) once it passes its probe on `device`; else `kernel` as it is (its rows form on
    the gathered rows), its reason saying why. Whichever kernel runs prefill (fla's too)."""
    why = triton_missing()
    if why is None:
        failed = probe_indexed(op, device, dtype, layout)
        why = None if failed is None else f"the triton kernel failed its probe ({failed})"
    if why is not None:
        return replace(kernel, reason=f"{kernel.reason}; decode rows gathered: {why}")
    return replace(kernel, reason=f"{kernel.reason}; decode rows: triton, state in place", decode_rows_indexed_=op)


def _fla_kernel(choice: KernelChoice, device, dtype, layout=PROBE_LAYOUT) -> tuple[GdnKernel | None, str | None]:
    why = probe(fla_adapter.fla_prefill, fla_adapter.fla_decode_step_, device, dtype, fla_adapter.fla_decode_rows_, layout)
    if why is not None:
        return None, why
    rows = gathered(fla_adapter.fla_decode_rows_)
    return GdnKernel("fla", choice.reason, fla_adapter.fla_prefill, fla_adapter.fla_decode_step_, rows), None


def _npu_kernel(choice: KernelChoice, device, dtype, layout=PROBE_LAYOUT) -> tuple[GdnKernel | None, str | None]:
    # fp32 state first: where the op takes it, the state is never rounded.
    whys = []
    for state_dtype in (torch.float32, torch.bfloat16):
        prefill = functools.partial(npu_adapter.npu_prefill, state_dtype=state_dtype)
        why = probe(prefill, gated_delta_step_torch_, device, dtype, layout=layout)
        if why is None:
            state = "fp32 state" if state_dtype == torch.float32 else "state rounded to bf16 per prefill: the op refused fp32"
            return GdnKernel("npu", f"{choice.reason}, {state}", prefill, gated_delta_step_torch_), None
        whys.append(f"{dtype_name(state_dtype)} state: {why}")
    return None, "; ".join(whys)


def torch_kernel(name: str, reason: str) -> GdnKernel:
    prefill = gated_delta_rule_recurrent if name == "recurrent" else gated_delta_rule_chunked
    return GdnKernel(name, reason, prefill, gated_delta_step_torch_)


_selected: dict[tuple, GdnKernel] = {}


def select_gdn_kernel(device, dtype: torch.dtype, env=os.environ, layout: tuple[int, int, int, int] = PROBE_LAYOUT) -> GdnKernel:
    """The kernel this process runs on `device` for `dtype`: planned, and for a device kernel
    probed once (per device, dtype and the caller's head layout, (Hk, Hv, Dk, Dv): a layer's own,
    the layout its kernels are then compiled for). A forced kernel that fails its probe is a usage
    error; an unforced one gives way to the torch chunked kernel, saying why."""
    device = torch.device(device)
    source, forced = env_setting(env, ENV)
    key = (device, dtype, forced, tuple(layout))
    if key in _selected:
        return _selected[key]
    choice = plan_gdn_kernel(device.type, dtype, env)
    if choice.name in ("fla", "npu"):
        build = _fla_kernel if choice.name == "fla" else _npu_kernel
        kernel, why = build(choice, device, dtype, layout)
        if kernel is None:
            if forced.strip():
                raise GdnKernelError(f"{source}={choice.name} failed its probe on {device}: {why}")
            kernel = torch_kernel("chunk", f"torch chunked kernel: {choice.name} failed its probe ({why})")
    else:
        kernel = torch_kernel(choice.name, choice.reason)
    if device.type == "cuda":
        kernel = with_triton_decode_rows(kernel, device, dtype, layout=layout)
    _selected[key] = kernel
    return kernel

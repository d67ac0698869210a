"""The gated delta rule's decode step of B sequences on the layer's stacked state, each sequence's
state at its slot's row, advanced in place: what a decode step of several sequences runs
(layers/gdn.py's decode rows, in the captured CUDA-graph step).

gated_delta_rows_indexed_torch_ is the torch form: it gathers the rows (a copy), advances them
with gated_delta_rows_torch_ and puts them back (another copy). pocketllm::gated_delta_rows_indexed_
is the same as a torch custom op: on CUDA the Triton kernel that reads and writes each slot's state
in place (ops/device/kernels/gated_delta_rows.py), elsewhere the torch form; to torch it is one
opaque op that mutates `state`, with a fake form so torch.compile and a CUDA graph capture trace
it. The kernel module is imported on the first CUDA call, so registering the op needs no Triton.

Shapes: q, k [B, Hk, Dk] (l2-normalised, q scaled by Dk**-0.5), v [B, Hv, Dv], g, beta [B, Hv],
state [S, Hv, Dk, Dv] fp32, slots [B] long, distinct except that rows may repeat a slot whose
result does not matter (a captured step's padding slot); out [B, Hv, Dv] fp32."""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch
from torch import Tensor

from pocketllm.ops.gated_delta.recurrent import gated_delta_rows_torch_


def _advance_gathered(decode_rows_: Callable, q, k, v, g, beta, state, slots) -> Tensor:
    """Gather the slots' rows of `state`, advance them by decode_rows_ (on gathered state
    [B, Hv, Dk, Dv], gated_delta_rows_torch_'s contract), put them back."""
    rows = state[slots]
    out = decode_rows_(q, k, v, g, beta, rows)
    state.index_copy_(0, slots, rows)
    return out


def gated_delta_rows_indexed_torch_(q, k, v, g, beta, state, slots) -> Tensor:
    """The torch form: gated_delta_rows_torch_ on the gathered rows, put back."""
    return _advance_gathered(gated_delta_rows_torch_, q, k, v, g, beta, state, slots)


def gathered(decode_rows_: Callable) -> Callable:
    """A decode_rows_ on gathered state (fla's) as the indexed form: gather, advance, put back."""
    return functools.partial(_advance_gathered, decode_rows_)


@torch.library.custom_op("pocketllm::gated_delta_rows_indexed_", mutates_args=("state",))
def gated_delta_rows_indexed_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor) -> Tensor:
    return gated_delta_rows_indexed_torch_(q, k, v, g, beta, state, slots)


@gated_delta_rows_indexed_op.register_kernel("cuda")
def _(q, k, v, g, beta, state, slots):
    module = importlib.import_module("pocketllm.ops.device.kernels.gated_delta_rows")
    return module.gated_delta_rows_indexed_(q, k, v, g, beta, state, slots)


@gated_delta_rows_indexed_op.register_fake
def _(q, k, v, g, beta, state, slots):
    return v.new_empty(v.shape, dtype=torch.float32)

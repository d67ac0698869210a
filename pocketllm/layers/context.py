"""What every layer needs to know about the pass it is in (built by the model, for the engine's
passes; a leaf module, so layers and engine both import it and neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pocketllm.ops.registry import one_row


@dataclass
class ForwardContext:
    start: int  # position of the first row
    slices: int  # the slice count the policy chose for these rows
    rows: int  # rows of the pass (of a packed pass: all its sequences' rows)
    # [rows, rotary_dim/2]; None for a packed pass, whose segments each carry their own.
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    # A pass over several sequences packs their rows one sequence after another; then each
    # token mixer runs once per sequence on its rows with that sequence's own state, and
    # everything else (projections, norms, MLP) runs on all rows at once. None: one sequence.
    segments: tuple[Segment, ...] | None = None

    @property
    def one_row(self) -> bool:
        """A pass of one decode row: its norms and mixers take their one-row (compiled) forms.
        Decided by the kernel registry's row classes, like the projections' kernels."""
        return one_row(self.rows)


@dataclass
class Segment:
    """One sequence's rows in a packed pass."""

    row0: int  # its first row in the pass
    ctx: ForwardContext  # its own positions, rows, cos/sin

    @property
    def rows(self) -> int:
        return self.ctx.rows


def per_sequence(mix, rows: torch.Tensor, ctx: ForwardContext, state) -> torch.Tensor:
    """mix(rows, ctx, state) once for the one sequence of a pass, or once per sequence of a packed
    pass on its own rows, context and state (state then holds one per sequence), the outputs
    stacked back in row order: how a token mixer runs on several sequences."""
    if ctx.segments is None:
        return mix(rows, ctx, state)
    return torch.cat([mix(rows[s.row0 : s.row0 + s.rows], s.ctx, st) for s, st in zip(ctx.segments, state)])

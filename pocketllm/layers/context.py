"""What every layer needs to know about the pass it is in (built by the model, for the engine's
passes; a leaf module, so layers and engine both import it and neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pocketllm.ops.registry import one_row


@dataclass
class Segment:
    """One sequence's rows in a pass: a pass packs its sequences' rows one after another."""

    row0: int  # its first row in the pass
    start: int  # the sequence position of that row
    rows: int
    cos: torch.Tensor  # [rows, rotary_dim/2] for its own positions
    sin: torch.Tensor

    @property
    def one_row(self) -> bool:
        """This sequence feeds one row: its mixer takes its one-row (compiled) form. Decided by
        the kernel registry's row classes, like the projections' kernels."""
        return one_row(self.rows)


@dataclass
class ForwardContext:
    """A pass over one or more sequences. Each token mixer runs once per sequence on its rows
    with that sequence's own state; everything else (projections, norms, MLP) runs on all rows at
    once."""

    slices: int  # the slice count the policy chose for all the pass's rows
    segments: tuple[Segment, ...]
    rows: int  # all the pass's rows

    @property
    def one_row(self) -> bool:
        """A pass of one row: its norms and MLP take their one-row (compiled) forms."""
        return one_row(self.rows)


def per_sequence(mix, rows: torch.Tensor, ctx: ForwardContext, state: list) -> torch.Tensor:
    """mix(rows, segment, state) once per sequence of the pass, on its own rows, segment and state
    (state holds one per sequence), the outputs stacked back in row order: how a token mixer runs
    on the sequences of a pass."""
    if len(ctx.segments) == 1:
        # One sequence: its rows are the pass's, and no copy joins the outputs.
        return mix(rows, ctx.segments[0], state[0])
    return torch.cat([mix(rows[s.row0 : s.row0 + s.rows], s, st) for s, st in zip(ctx.segments, state)])

"""What every layer needs to know about the pass it is in (built by the model, for the engine's
passes; a leaf module, so layers and engine both import it and neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    start: int  # position of the first row
    slices: int  # the slice count the policy chose for these rows
    decode: bool
    cos: torch.Tensor  # [rows, rotary_dim/2]
    sin: torch.Tensor
    # A pass over several sequences packs their rows one sequence after another; then each
    # token mixer runs once per sequence on its rows with that sequence's own state, and
    # everything else (projections, norms, MLP) runs on all rows at once. None: one sequence.
    segments: tuple[Segment, ...] | None = None


@dataclass
class Segment:
    """One sequence's rows in a packed pass."""

    row0: int  # its first row in the pass
    ctx: ForwardContext  # its own positions: start, decode (one row past position 0), cos/sin

    @property
    def rows(self) -> int:
        return self.ctx.cos.shape[0]

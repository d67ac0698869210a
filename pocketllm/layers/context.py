"""What every layer needs to know about the pass it is in (built by the model, for the engine's
passes; a leaf module, so layers and engine both import it and neither imports the other)."""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass(frozen=True)
class Part:
    """Rows start..end of a pass that the projections, norms and activation run in calls of their
    own: a run of single rows, each its own sequence's (`alone`: each row gets the one-row forms'
    bits, as it would alone), or the rows of one segment of a prompt (`many`: the many-row
    kernel whatever its row count, so what they get does not depend on which few-row kernels the
    engine holds), or (neither) all a pass's rows, by their row count."""

    start: int
    end: int
    alone: bool
    slices: int = 1  # the slice count of its row-parallel projections
    many: bool = False

    @property
    def rows(self) -> slice:
        return slice(self.start, self.end)

    def kernel(self, kernels):
        """The call of bound kernels (ops.registry.BoundKernels) this part's rows run."""
        return kernels.alone if self.alone else kernels.many if self.many else kernels


def parts_of(segments: tuple[Segment, ...], rows: int, slices: int, invariant: bool, slices_for: Callable[[int], int]) -> tuple[Part, ...]:
    """How a pass's rows are cut into calls. Batch-invariant: every prompt segment alone, and the
    single rows of consecutive one-row segments together, so nothing a row gets depends on the
    other sequences of the pass; `slices_for(rows)` slices a segment by its own rows. Otherwise
    one part of all the rows, taking the forms its row count takes."""
    if not invariant:
        return (Part(0, rows, one_row(rows), slices),)
    parts: list[Part] = []
    for s in segments:
        if s.one_row and parts and parts[-1].alone:
            parts[-1] = Part(parts[-1].start, s.row0 + 1, True)
        elif s.one_row:
            parts.append(Part(s.row0, s.row0 + 1, True))
        else:
            parts.append(Part(s.row0, s.row0 + s.rows, False, slices_for(s.rows), many=True))
    return tuple(parts)


@dataclass
class ForwardContext:
    """A pass over one or more sequences. Each token mixer runs once per segment on its rows
    with that sequence's own state; projections, norms and the MLP run part by part (`parts`)."""

    slices: int  # the slice count the policy chose for all the pass's rows
    segments: tuple[Segment, ...]
    rows: int  # all the pass's rows
    parts: tuple[Part, ...]  # how its rows are cut into calls (parts_of)
    # The row each span of the pass ends on (its logits are the ones returned).
    last: tuple[int, ...]
    invariant: bool  # parts cut by parts_of(invariant=True)

    @property
    def one_row(self) -> bool:
        """A pass of one row: its norms and MLP take their one-row (compiled) forms."""
        return one_row(self.rows)


def per_sequence(mix, rows: torch.Tensor, ctx: ForwardContext, state: list) -> torch.Tensor:
    """mix(rows, segment, state) once per segment of the pass, in order, on its own rows, segment
    and state (state holds one per segment; consecutive segments of one sequence share theirs),
    the outputs stacked back in row order: how a token mixer runs on the sequences of a pass."""
    if len(ctx.segments) == 1:
        # One sequence: its rows are the pass's, and no copy joins the outputs.
        return mix(rows, ctx.segments[0], state[0])
    return torch.cat([mix(rows[s.row0 : s.row0 + s.rows], s, st) for s, st in zip(ctx.segments, state)])

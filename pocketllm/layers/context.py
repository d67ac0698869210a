"""What every layer needs to know about the pass it is in (built by the model, for the engine's
passes; a leaf module, so layers and engine both import it and neither imports the other)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pocketllm.ops.registry import one_row


@dataclass(frozen=True)
class PassShape:
    """How a pass's rows are cut into calls and which forms the calls take: the CPU's shape or a
    device's, chosen once from the device the engine runs on (for_device; a test may force either).

    The CPU's shape serves batch invariance and the CPU's caches. Batch-invariant (the default,
    POCKETLLM_BATCH_INVARIANT), a sequence's prompt rows run in segments cut at multiples of the
    prefill chunk and each segment's projections, norms and activation in calls of their own, so a
    prompt position's bits do not depend on how its prompt was cut into passes or on what else a
    pass holds (docs/batching.md); the row-wise ops go by cache-sized row blocks or their compiled
    C rows forms.

    A device's shape serves the device: a sequence's consecutive rows in a pass are one segment
    (its token mixer's one call, the gated delta rule's one call per layer), and the projections,
    norms with their residual adds and the activation run once over all the pass's rows, in the
    device's forms (ops/device: Triton kernels on CUDA; no row blocks, no compiled C forms: CPU
    cache measures). It makes no batch-
    invariant cuts, and promises no batch invariance: cuBLAS-like GEMMs pick their kernels by the
    call's shape, so a row's bits may change with the pass's other rows and with where a prompt was
    cut into passes. What it promises: the model's arithmetic within the dtype's rounding (fp32
    logits close to the CPU shape's, tests/test_device_pass_shape.py), the same passes giving the
    same results where the device's kernels are deterministic.

    A device's batch-invariant shape (POCKETLLM_BATCH_INVARIANT=1 set on a device) cuts as the
    CPU's does, each prompt segment's projections in calls of their own, so a GEMM's rows are
    the same whatever else the pass holds, and runs every decode step at the slots' count of rows
    (fixed_step): the device's forms for the rest, each of which gives a row the same bits
    whatever the other rows (one program per row; attention shares cut by position)."""

    name: str
    # Batch-invariant runs cut prompt rows at multiples of the prefill chunk, each segment (and a
    # pass's run of decode rows) in calls of its own (parts_of).
    invariant_cuts: bool
    # Consecutive spans of one sequence in a pass run as one segment.
    whole_sequences: bool
    # The row-wise ops may take the CPU's cache measures: row blocks, compiled C rows forms.
    cpu_forms: bool
    # A decode step runs at one row count, the slots': its GEMMs' shapes, and so their kernels,
    # the same whatever the number of sequences decoding (GEMMs that pick a kernel by shape).
    fixed_step: bool = False

    @staticmethod
    def for_device(device: torch.device | str, invariant: bool = False) -> PassShape:
        """The shape of passes on `device` (a torch.device, or its name: "npu" is one without
        torch_npu imported): the CPU's on a CPU, a device's anywhere else (its batch-invariant
        one where `invariant`)."""
        kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
        if kind == "cpu":
            return CPU_PASS
        return DEVICE_INVARIANT_PASS if invariant else DEVICE_PASS


CPU_PASS = PassShape("cpu", invariant_cuts=True, whole_sequences=False, cpu_forms=True)
DEVICE_PASS = PassShape("device", invariant_cuts=False, whole_sequences=True, cpu_forms=False)
DEVICE_INVARIANT_PASS = PassShape("device, batch-invariant", invariant_cuts=True, whole_sequences=False, cpu_forms=False, fixed_step=True)


@dataclass
class Segment:
    """One sequence's rows in a pass: a pass packs its sequences' rows one after another."""

    row0: int  # its first row in the pass
    start: int  # the sequence position of that row
    rows: int
    cos: torch.Tensor  # [rows, rotary_dim/2] for its own positions
    sin: torch.Tensor
    cpu_forms: bool = True  # its mixer's row-wise ops may take row blocks and compiled C forms (PassShape)

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
    cpu_forms: bool = True  # its norms and activation may take row blocks and compiled C forms (PassShape)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.end)

    def kernel(self, kernels):
        """The call of bound kernels (ops.registry.BoundKernels) this part's rows run."""
        return kernels.alone if self.alone else kernels.many if self.many else kernels


def part_forms_on_cpu(shape: PassShape, invariant: bool, device_kernels: bool) -> bool:
    """Whether a pass's parts take the CPU's row-wise forms (parts_of's cpu_forms): on a CPU; and
    on a device whose batch-invariant pass has no kernels that give each row its own bits in a
    call of many rows (its ops' torch forms reduce as torch chooses for the row count), so its
    rows go as they would alone."""
    return shape.cpu_forms or (invariant and not device_kernels)


def parts_of(segments: tuple[Segment, ...], rows: int, slices: int, invariant: bool, slices_for: Callable[[int], int], cpu_forms: bool = True) -> tuple[Part, ...]:
    """How a pass's rows are cut into calls. Batch-invariant: every prompt segment alone, and the
    single rows of consecutive one-row segments together, so nothing a row gets depends on the
    other sequences of the pass; `slices_for(rows)` slices a segment by its own rows. Otherwise
    one part of all the rows, taking the forms its row count takes (and, without cpu_forms, the
    device's forms over all of them: a device's pass)."""
    if not invariant:
        return (Part(0, rows, one_row(rows), slices, cpu_forms=cpu_forms),)
    # A device's kernels (cpu_forms False: part_forms_on_cpu) give each row its own bits in a call
    # of any rows, so its parts take them over all their rows too.
    parts: list[Part] = []
    for s in segments:
        if s.one_row and parts and parts[-1].alone:
            parts[-1] = Part(parts[-1].start, s.row0 + 1, True, cpu_forms=cpu_forms)
        elif s.one_row:
            parts.append(Part(s.row0, s.row0 + 1, True, cpu_forms=cpu_forms))
        else:
            parts.append(Part(s.row0, s.row0 + s.rows, False, slices_for(s.rows), many=True, cpu_forms=cpu_forms))
    return tuple(parts)


@dataclass
class DecodeRows:
    """A pass of B decode rows, one per sequence, described by tensors alone (a fixed-size step's
    buffers): each mixer runs all of them in one call on its state of every slot (GDNStates, or
    the KV pool), read and written by slot. Nothing in such a pass is sized by the data or branches on
    it, so a captured step replays it."""

    pos: torch.Tensor  # [B] long: each row's position
    slots: torch.Tensor  # [B] long: each row's slot
    tables: torch.Tensor  # [B, M] int32: each row's slot's block table
    cos: torch.Tensor  # [B, rotary_dim/2]: each row's rotary row
    sin: torch.Tensor


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
    # A pass of decode rows described by tensors (segments then empty), or None.
    decode_rows: DecodeRows | None = None
    shape: PassShape = CPU_PASS

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

"""The resident engine on one rank: the model with its weights loaded, the slice policy, the slots
that hold its sequences' decode state, and the one pass every command is made of: rows of one or
more sequences, each going on from its own position in its own slot (a prefill is a sequence's
prompt rows from position 0, a decode step its one next row)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass

import torch

from pocketllm import host_memory
from pocketllm.config import ModelConfig
from pocketllm.device import to_device
from pocketllm.distributed.accounting import COUNTER
from pocketllm.distributed.overlap import is_serial
from pocketllm.distributed.policy import SlicePolicy
from pocketllm.distributed.state import group_pids, tp
from pocketllm.engine import decode_step
from pocketllm.engine.slots import Slots
from pocketllm.layers.context import PassShape
from pocketllm.loader.load import load_weights
from pocketllm.models.qwen3_5 import Qwen35ForCausalLM
from pocketllm.ops.registry import KernelSet, batch_invariant
from pocketllm.ops.registry.layout import choose_layout
from pocketllm.profiling.scopes import recording

# Batch-invariant on a CPU (PassShape.invariant_cuts), a sequence's prompt rows run in segments
# that end where its positions reach a multiple of this (and where the caller's span ends),
# whatever else a pass holds: what a prompt position gets depends on that sequence alone as long
# as its spans end on such multiples or at the prompt's end, as the scheduler cuts them.
# A multiple of the KV block size, so the prefix cache's entries at segment ends hold whole
# blocks; big enough that a segment's GEMMs run near their full rate, small enough that a chat's
# next turn, which starts from the last segment end of its history, reads little of it again
# (docs/batching.md).
PREFILL_CHUNK = 256


def chunk_bounds(start: int, rows: int, chunk: int) -> list[tuple[int, int]]:
    """The row ranges of `rows` rows from position `start` cut where positions reach multiples of
    `chunk` (0: not cut)."""
    if chunk <= 0 or rows <= 1:
        return [(0, rows)]
    out, a = [], 0
    while a < rows:
        b = min(rows, (start + a) // chunk * chunk + chunk - start)
        out.append((a, b))
        a = b
    return out


def whole_sequences(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(slot, start, rows) pieces with each run of one slot's consecutive positions joined into
    one: a sequence's rows in a device's pass are one segment, its mixers' one call."""
    out: list[tuple[int, int, int]] = []
    for slot, start, rows in pieces:
        if out and out[-1][0] == slot and out[-1][1] + out[-1][2] == start:
            out[-1] = (slot, out[-1][1], out[-1][2] + rows)
        else:
            out.append((slot, start, rows))
    return out


@dataclass
class PassInfo:
    """What one forward pass is, for the hooks that watch passes (profilers, fault injection)."""

    index: int  # unique within the run
    kind: str  # "warmup", "prefill" or "decode"
    rows: int
    slices: int
    timed: bool  # the timed pass of a bench
    collectives: dict | None = None  # filled after the pass: all-reduces per site
    direct: bool = False  # a decode row run straight by the decode-step backend, not the layers

    @property
    def serial(self) -> bool:
        """Whether the row-parallel projections take the unsliced path (asked only by a profiler,
        so a plain pass pays nothing for it)."""
        return is_serial(self.rows, self.slices)


class Engine:
    def __init__(self, cfg: ModelConfig, source, dtype: torch.dtype, device: torch.device, policy: SlicePolicy):
        self.cfg, self.dtype, self.device, self.policy = cfg, dtype, device, policy
        if device.type == "cpu":
            # Before this engine's first GEMM (the kernel measurements below): torch reads the
            # bounds when it first builds a GEMM.
            host_memory.bound_gemm_caches()
        self.model = Qwen35ForCausalLM(cfg, dtype, device)
        # load_weights closes the source after every parameter.
        self.loaded_bytes = load_weights(self.model, source, progress=tp().rank == 0)
        if device.type == "cpu":
            host_memory.keep_freed_blocks()
        # How the bf16 weights are held (rows or panels, ops.registry.layout), before the
        # kernels of that layout are measured: a step of one sequence's choice, until
        # reserve_slots says steps will hold several.
        self.layout = choose_layout(self.model.projection_weights(), peers=group_pids())
        self.held = "rows"
        self._hold(self.layout.for_rows(1))
        # The kernels the projections run, measured here (or read from this machine's cache and
        # checked), each projection bound to its own. The other ranks measure at the same time:
        # their CPU time is no sign of a busy machine.
        self.kernels = KernelSet.choose(self.model.projection_weights(), peers=group_pids())
        # POCKETLLM_BATCH_INVARIANT (a CPU's default on, a device's off), as the kernel choices read it.
        self.invariant = batch_invariant(os.environ, device.type)
        self.prefill_chunk = PREFILL_CHUNK
        # How a pass's rows are cut into calls and which forms they take: the CPU's shape (batch-
        # invariant cuts, row blocks, compiled C forms) or a device's (whole sequences, whole
        # rows; batch-invariant, the CPU's cuts and a decode step of fixed rows); a test may force
        # DEVICE_PASS on a CPU.
        self.pass_shape = PassShape.for_device(device, self.invariant)
        self.model.bind_kernels(self.kernels)
        # The sequences' state: their slots, the KV pool and the prefix cache's entries.
        self.slots = Slots(self.model, device)
        self._choose_step()
        self.say = None  # where the engine reports a choice it makes after loading (rank 0's stderr)
        # before_pass(info) / after_pass(info) around every pass; a hook whose watches_layers is
        # False only records where the run is, and a decode row still goes to the step under it.
        self.hooks: list = []
        self.direct_steps = 0  # decode rows the step backend ran
        self.last_pass: PassInfo | None = None
        self._passes = 0
        self._warmup = False
        self._timed = False

    @property
    def last_collectives(self) -> dict[str, int]:
        return self.last_pass.collectives if self.last_pass else {}

    @property
    def last_slices(self) -> int:
        """The slice count the last pass's row-parallel projections ran with: 1 where they ran
        serial (one rank, or fewer rows than the count the policy chose or a pin set)."""
        return 1 if self.last_pass is None or self.last_pass.serial else self.last_pass.slices

    @contextlib.contextmanager
    def tagged(self, warmup: bool = False, timed: bool = False):
        """Label the passes run inside: warm-up passes, or the timed passes of a bench."""
        saved = self._warmup, self._timed
        self._warmup, self._timed = warmup, timed
        try:
            yield
        finally:
            self._warmup, self._timed = saved

    def reserve_slots(self, count: int, max_len: int, kv_blocks: int | None = None) -> None:
        """Room for `count` sequences of up to `max_len` positions each (Slots.reserve), the
        rotary table for them, and the few-row kernels their decode steps run."""
        if self._passes == 0 and self.layout.for_rows(count) != self.held:
            # Before any pass (so every row of the run sums alike): the weights in the layout for
            # steps of `count` sequences, and the kernels of that layout measured. The step goes
            # first: it holds every weight it calls, which would keep both layouts alive.
            self.step = self.step_choice = None
            self._hold(self.layout.for_rows(count))
            self.kernels = KernelSet.choose(self.model.projection_weights(), peers=group_pids())
            self.model.bind_kernels(self.kernels)
            self._choose_step()
            if self.say is not None:
                self.say(self.layout.describe(count))
                for line in self.kernels.describe():
                    self.say(line)
        self.slots.reserve(count, max_len, kv_blocks)
        self.model.rotary.reserve(max_len)
        # A decode step of `count` sequences has `count` rows: the few-row kernels for every
        # power of two up to it, measured (or read from this machine's cache) once.
        new = self.kernels.choose_few(self.model.projection_weights(), count)
        if new:
            self.model.bind_kernels(self.kernels)
            self._choose_step()
            for choice in new:
                if self.say is not None:
                    self.say(self.kernels.line(choice))
        if hasattr(self.step, "prepare"):
            # A captured step is captured now, for these slots, not on the first request; one
            # that cannot be leaves the layers' path, saying why.
            said = self.describe_step()
            try:
                self.step.prepare()
            except Exception as exc:  # any failure to capture or check the step: do not trust it
                if tp().world > 1:
                    # A rank alone on the layers' path would all-reduce other shapes than its
                    # peers' step (NCCL hangs on that, or sums garbage), and one that failed inside
                    # the warm-up leaves its peers waiting in a collective: the run ends instead.
                    raise RuntimeError(f"decode step: {self.step_choice.name} failed on rank {tp().rank} at TP={tp().world}: "
                                       f"{type(exc).__name__}: {decode_step.first_line(exc)}{decode_step.without(self.step_choice)}") from exc
                self.step_choice = decode_step.failed(self.step_choice, exc)
                self.step = None
            # What the step holds now (a captured step's buckets, set for these slots), where the
            # line said at load could not know it.
            if self.say is not None and self.describe_step() != said:
                self.say(self.describe_step())

    def warm_up_shapes(self, slot: int = 0) -> None:
        """One untimed pass of each row-count class a device's kernels compile for (Triton
        specializes an integer argument that is 1 or a multiple of 16): a prompt of 16 rows, one of
        17, and a decode row, in `slot`, which is left free. On a device, so that a server's first
        request does not wait for compiles (the decode graphs are captured when the slots are
        reserved). Every rank runs it alike."""
        # Each prompt leaves room for the decode row after it in a slot of the reserved length.
        lengths = [rows for rows in (16, 17) if rows < self.slots.capacity] or [max(1, self.slots.capacity - 1)]
        with self.tagged(warmup=True):
            for rows in lengths:
                logits = self.run_packed([(slot, 0, torch.zeros(rows, dtype=torch.long))])
            if lengths[-1] < self.slots.capacity:
                self.run_packed([(slot, lengths[-1], torch.argmax(logits, dim=-1).cpu())])
        self.slots.begin(slot)

    # inference_mode, not no_grad: no version counters or view tracking on the hundreds of small
    # ops of a decode step.
    @torch.inference_mode()
    def run_packed(self, spans: list[tuple[int, int, torch.Tensor]], all_logits: bool = False) -> torch.Tensor:
        """One pass over one or more sequences: spans are (slot, start position, ids [rows]), the
        rows of each going on from `start` in that slot's state; a span starting at position 0
        begins a new sequence in its slot, whose previous state is cleared (and KV blocks freed)
        first. Several spans of one slot run in their order, each from where the one before ended.
        The slot's sequence gets the KV blocks its new positions need from the pool
        (RuntimeError if the pool lacks them: the caller makes room first). Returns the
        fp32 logits of each span's last row [len(spans), V], or of every row [rows, V] with
        all_logits. Batch-invariant on a CPU, a span's rows run in segments cut at multiples of
        prefill_chunk positions; on a device, each sequence's consecutive rows run as one segment
        (self.pass_shape), and decode rows beside prompt rows run as a step of their own
        (_through_step)."""
        if len(spans) == 1 and not all_logits and spans[0][2].shape[0] == 1:
            slot, start, ids = spans[0]
            info = self._direct_step(slot, start)
            if info is not None:
                logits = self.step.logits(int(ids[0]), start, slot).view(1, -1)
                self._after_direct(info)
                return logits
        if len(spans) > 1 and hasattr(self.step, "rows"):
            stepped = self._through_step(spans, all_logits)
            if stepped is not None:
                return stepped
        # A pass of decode steps only (its label for profiles and hooks too).
        decode = all(ids.shape[0] == 1 and start > 0 for _, start, ids in spans)
        total, pieces, last = 0, [], []
        shape = self.pass_shape
        cut = self.invariant and shape.invariant_cuts
        chunk = self.prefill_chunk if cut else 0
        for slot, start, ids in spans:
            rows = ids.shape[0]
            if start == 0:
                self.slots.begin(slot)
            self.slots.grow(slot, start + rows)
            pieces += [(slot, start + a, b - a) for a, b in chunk_bounds(start, rows, chunk)]
            total += rows
            last.append(total - 1)
        if shape.whole_sequences:
            pieces = whole_sequences(pieces)
        slices = self.policy.slices_for_rows(total)
        ctx = self.model.context([(start, rows) for _, start, rows in pieces], slices, tuple(last), cut, self.policy.slices_for_rows, shape)
        ids = spans[0][2] if len(spans) == 1 else torch.cat([ids for _, _, ids in spans])
        return self._pass(to_device(ids, self.device), ctx, [self.slots[slot] for slot, _, _ in pieces], decode, slices, all_logits)

    def _through_step(self, spans: list[tuple[int, int, torch.Tensor]], all_logits: bool = False) -> torch.Tensor | None:
        """The spans' last-row logits (every row's, with all_logits) where the step backend takes
        the pass's decode rows (a row going on in a slot no other span holds: a sequence's second
        row needs its first's state): a pass of such rows alone, as one step; on a device, such
        rows beside prompt rows too, the rest then a pass of the layers of its own. In that one
        pass each decode row would be a segment of its own, every op of its mixer launched for it
        alone, with other bits than a step gives it; a request that reads every row of its prompt
        beside them must not change theirs. On a device a slot whose every span is one decode row
        (a preempted request's chosen tokens replayed, in order) is stepped too, its k-th row in
        the pass's k-th step: each row gets the bits a step gave it the first time. None where the
        step does not take them (the layers run the pass)."""
        one_row = [ids.shape[0] == 1 and start > 0 for _, start, ids in spans]
        if self.pass_shape.cpu_forms:
            # On a CPU a row's bits do not depend on the rows beside it: only a pass of single
            # decode rows, each of a slot of its own, is a step.
            if not all(one_row) or len({slot for slot, _, _ in spans}) < len(spans):
                return None
            waves = [list(range(len(spans)))]
        else:
            other = {slot for (slot, _, _), single in zip(spans, one_row) if not single}
            waves, seen = [], Counter()
            for i, (slot, _, _) in enumerate(spans):
                if slot not in other:
                    if seen[slot] == len(waves):
                        waves.append([])
                    waves[seen[slot]].append(i)
                    seen[slot] += 1
        if not waves or self._watched():
            return None
        steps = []
        for wave in waves:
            info = self._direct_rows([spans[i][:2] for i in wave])
            tokens = torch.cat([spans[i][2] for i in wave]).tolist()  # one op, not one per row
            steps.append(self.step.rows(tokens, [spans[i][1] for i in wave], [spans[i][0] for i in wave]))
            self._after_direct(info)
        if len(waves[0]) == len(spans):
            return steps[0]  # a pass of decode rows alone, one step: its rows are the spans in order
        taken = {i: logits[k : k + 1] for wave, logits in zip(waves, steps) for k, i in enumerate(wave)}
        others = [span for i, span in enumerate(spans) if i not in taken]
        rest = self.run_packed(others, all_logits=all_logits).to(steps[0].device) if others else None
        # Every span's rows in span order (its last row's alone without all_logits): one cat, where
        # index assignment with a list of rows would copy the list to the device first.
        parts, at = [], 0
        for i, (_, _, ids) in enumerate(spans):
            if i in taken:
                parts.append(taken[i])
            else:
                rows = ids.shape[0] if all_logits else 1
                parts.append(rest[at : at + rows])
                at += rows
        return torch.cat(parts)

    def greedy_row(self, slot: int, pos: int, token: int) -> int:
        """One decode step of the sequence in `slot`, `token` at position `pos`: its greedy next
        token (torch.argmax of run_packed's logits for that row). Where the step is one compiled
        call, with no torch op at all: the argmax is found in C."""
        info = self._direct_step(slot, pos)
        if info is None:
            return int(torch.argmax(self.run_packed([(slot, pos, torch.tensor([token], dtype=torch.long))])[0]))
        token = self.step.greedy(token, pos, slot)
        self._after_direct(info)
        return token

    def _hold(self, layout: str) -> None:
        """The bf16 projection weights held in `layout` ("rows" or "panels")."""
        if layout == self.held:
            return
        if layout == "panels":
            self.model.hold_in_panels()
        else:
            self.model.hold_as_loaded()
        self.held = layout

    def _choose_step(self) -> None:
        """The decode-step backend for the kernels the projections are bound to now."""
        self.step_choice = decode_step.choose(self)
        self.step = self.step_choice.backend

    def describe_step(self) -> str:
        """What a decode step of one sequence runs, for rank 0 to print."""
        return self.step_choice.describe()

    def _direct_step(self, slot: int, pos: int) -> PassInfo | None:
        """Where the step backend can run this pass of one sequence's one decode row (the sequence
        going on, no hook watching the layers, nothing profiled): the pass begun as a pass is, for
        _after_direct to end; else None. Such a row skips the pass's Python (context, segments)."""
        if self.step is None or pos <= 0 or self._watched():
            return None
        return self._direct_rows([(slot, pos)])

    def _watched(self) -> bool:
        """Whether something watches the layers' scopes (a profile recording, a hook that sees
        them), which the step backend skips: such a pass runs on the layers."""
        return recording() or any(getattr(h, "watches_layers", True) for h in self.hooks)

    def _direct_rows(self, rows: list[tuple[int, int]]) -> PassInfo:
        """A pass of decode rows, (slot, position) each, that the step backend runs together (where
        nothing is _watched), begun as a pass is, for _after_direct to end."""
        for slot, pos in rows:
            self.slots.grow(slot, pos + 1)
        return self._begin(len(rows), True, self.policy.slices_for_rows(len(rows)), direct=True)

    def _after_direct(self, info: PassInfo) -> None:
        self._end(info)
        self.direct_steps += info.rows

    def _begin(self, rows: int, decode: bool, slices: int, direct: bool = False) -> PassInfo:
        """A new pass's info, labelled and counted, shown to the hooks."""
        kind = "warmup" if self._warmup else ("decode" if decode else "prefill")
        info = PassInfo(self._passes, kind, rows, slices, self._timed, {} if direct else None, direct)
        self._passes += 1
        for hook in self.hooks:
            hook.before_pass(info)
        return info

    def _end(self, info: PassInfo) -> None:
        for hook in self.hooks:
            hook.after_pass(info)
        self.last_pass = info

    def _pass(self, ids: torch.Tensor, ctx, states: list, decode: bool, slices: int, all_logits: bool) -> torch.Tensor:
        info = self._begin(ids.shape[0], decode, slices)
        COUNTER.reset()
        logits = self.model(ids, ctx, states, all_logits=all_logits)
        info.collectives = COUNTER.snapshot()
        self._end(info)
        return logits

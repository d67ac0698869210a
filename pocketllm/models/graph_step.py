"""A decode step of several sequences over fixed buffers, captured once per batch-size bucket as a
CUDA graph and replayed: the device backend of the engine's decode-step seam
(pocketllm/engine/decode_step.py). On a device every op of a step is a kernel launch issued from
Python; replaying a captured step issues them all at once.

The step is the model's own forward, in its pass of decode rows (layers.context.DecodeRows): token
ids, positions and slots in buffers of the bucket's size, each row's block table gathered from the
slots' table of every slot, its rotary row from the model's table, each mixer's state of every
slot read and written by slot index inside the step. Nothing in it allocates outside the graph's pool,
synchronises or branches on data, so the same step runs captured on CUDA and uncaptured anywhere
(a CPU test compares it with the layers' pass). Rows beyond a bucket's real ones run in the slots'
padding slot, which no sequence holds.

The buffers and graphs hold the addresses of the slots' state: they are rebuilt when the slots
are reserved again (Slots.generation). `POCKETLLM_CUDA_GRAPH=0` keeps the layers' path; at TP>1
the layers' path is the default and `POCKETLLM_CUDA_GRAPH=1` captures the step with its
all-reduces."""

from __future__ import annotations

import os

import torch

from pocketllm.device import copy_to_device_
from pocketllm.distributed.state import tp
from pocketllm.layers.context import DecodeRows, ForwardContext, Segment, part_forms_on_cpu, parts_of
from pocketllm.switches import env_switch, env_value

ENV_GRAPH = "POCKETLLM_CUDA_GRAPH"
# The batch sizes a step is captured for (and the slots' count, when not one of them): a pass of
# n rows replays the smallest bucket of at least n rows.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The most a replay may differ from the step run uncaptured, relative to the largest logit (the
# same kernels on the same inputs: a difference is a capture that holds a stale value).
REPLAY_TOLERANCE = 1e-3


def why_not(model, env=os.environ) -> str | None:
    """Why the model's decode steps cannot run as captured graphs ("" when they can; None off a
    CUDA device, where the question does not arise)."""
    if model.embed.weight.device.type != "cuda":
        return None
    # At TP>1 the step holds each projection's all-reduce: NCCL's collectives are captured with
    # the kernels (torch supports it), and the step's forward at TP>1 is the layers' (a CPU test
    # over gloo), but no capture with collectives has run on GPUs here yet: asked for, not taken.
    multi = tp().world != 1
    if env_switch(env, ENV_GRAPH, default=not multi):
        return ""
    if multi and not env_value(env, ENV_GRAPH).strip():
        return f"TP>1 (the all-reduces' capture has not run on GPUs yet: {ENV_GRAPH}=1 captures them)"
    return f"{ENV_GRAPH}=0"


def buckets_for(count: int) -> tuple[int, ...]:
    """The buckets a step of up to `count` rows is captured for."""
    return tuple(sorted({b for b in BUCKETS if b < count} | {count}))


class GraphStep:
    """The model's decode step of up to as many sequences as the engine's slots hold, at once.
    capture: record each bucket's step as a CUDA graph and replay it (default: on a CUDA device);
    else run the same step each time."""

    why_not = staticmethod(why_not)

    def __init__(self, engine, capture: bool | None = None):
        self.model, self.slots, self.shape = engine.model, engine.slots, engine.pass_shape
        # The calls a pass of decode rows is cut into, as the engine's passes are (run_packed).
        self.invariant = engine.invariant and engine.pass_shape.invariant_cuts
        self.slices_for = engine.policy.slices_for_rows
        self.device = self.model.embed.weight.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        # The whole vocabulary's ids: at TP>1 the embedding here holds only this rank's rows of it.
        self.vocab = engine.cfg.vocab_size
        self._generation = -1
        self.buckets: tuple[int, ...] = ()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}

    def describe(self) -> str:
        what = "cuda graph" if self.capture else "fixed buffers, uncaptured"
        if self.shape.fixed_step and self.buckets:
            return f"{what} (every step at {self.buckets[0]} rows: batch-invariant)"
        return f"{what} (B buckets {','.join(map(str, self.buckets))})" if self.buckets else what

    def logits(self, token: int, pos: int, slot: int) -> torch.Tensor:
        """fp32 logits [vocab] of one sequence's decode row."""
        return self.rows([token], [pos], [slot])[0]

    def greedy(self, token: int, pos: int, slot: int) -> int:
        return int(torch.argmax(self.rows([token], [pos], [slot])[0]))

    @torch.inference_mode()
    def rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """fp32 logits [n, vocab] of n sequences' decode rows (token, position, slot each; the
        slots' sequences hold the KV blocks their positions need)."""
        n = len(tokens)
        for token in tokens:
            if not 0 <= token < self.vocab:
                # An index past the table is a device-side assert on CUDA, fatal to the process.
                raise IndexError(f"token id {token} is outside the embedding's {self.vocab} rows")
        self.prepare()
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            raise ValueError(f"a step of {n} rows: the slots hold {self.buckets[-1]} sequences")
        pad = bucket - n
        host = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots + [self.slots.padding] * pad], dtype=torch.long)
        copy_to_device_(self.inputs[:, :bucket], host)
        if self.capture:
            self.graphs[bucket].replay()
        else:
            self.out[bucket] = self._forward(bucket)
        # A copy: the bucket's output is overwritten by its next replay.
        return self.out[bucket][:n].clone()

    @torch.inference_mode()
    def prepare(self) -> None:
        """Buffers and graphs for the slots as they are reserved now, made once per reserve: the
        engine calls it when it reserves slots, so no request waits for a capture."""
        if self._generation != self.slots.generation:
            self._build()

    def _forward(self, bucket: int) -> torch.Tensor:
        """The model's forward over the first `bucket` rows of the input buffers."""
        ids, pos, slot = self.inputs[0, :bucket], self.inputs[1, :bucket], self.inputs[2, :bucket]
        model, slots = self.model, self.slots
        cos, sin = model.rotary.rows(pos)
        rows = DecodeRows(pos, slot, slots.blocks.ids[slot], cos, sin)
        # A pass of one-row segments, cut into calls as such a pass of the layers' path is.
        one = tuple(Segment(i, 0, 1, cos[:0], sin[:0]) for i in range(bucket))
        slices = self.slices_for(bucket)
        on_cpu = part_forms_on_cpu(self.shape, self.invariant, model.decode_ops.device.kernels)
        parts = parts_of(one, bucket, slices, self.invariant, self.slices_for, on_cpu)
        ctx = ForwardContext(slices, (), bucket, parts, tuple(range(bucket)), self.invariant, decode_rows=rows, shape=self.shape)
        states = [[slots.stacked_state(i) for i in range(len(model.layers))]]
        return model(ids, ctx, states)

    def _build(self) -> None:
        """Buffers for the slots as they are reserved now, and each bucket's graph."""
        self.graphs, self.out = {}, {}
        count = max(1, len(self.slots.states))
        # A fixed step (a device's batch-invariant shape) runs every step at the slots' count.
        self.buckets = (count,) if self.shape.fixed_step else buckets_for(count)
        top = self.buckets[-1]
        self.inputs = torch.zeros(3, top, dtype=torch.long, device=self.device)
        self.inputs[2] = self.slots.padding
        self._generation = self.slots.generation
        if not self.capture:
            return
        # Warm up every bucket off the capturing stream (lazy inits, workspace), then capture the
        # biggest first so the smaller reuse its memory from the one pool. The buffers hold the
        # padding slot's rows throughout: only its scratch state is written.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bucket in reversed(self.buckets):
                for _ in range(2):
                    self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's unsafe calls can spoil the capture, not another
            # thread's that touch the device meanwhile (NCCL's watchdog querying the events of
            # the warm-up's collectives at TP > 1, a server's other threads).
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.out[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        why = self.replay_disagrees(self.buckets[0])
        if why:
            raise RuntimeError(why)

    def replay_disagrees(self, bucket: int) -> str:
        """Why a replay of `bucket`'s graph differs from the same step run uncaptured ("" when it
        agrees): a capture that baked in a value it should read from a buffer shows here. Both run
        each row in a slot of its own from a cleared state (the real slots, free while they are
        being reserved, and put back after): rows of one slot would race on its state, one row's
        window or recurrence read before or after another's write, and differ run to run."""
        # A bucket holds at most the real slots' rows (a reserve of none is bucket 1 in slot 0, the
        # padding slot then).
        def clear():
            for states in self.slots.stacked.values():
                for slot in range(bucket):
                    states.slot(slot).reset()

        self.inputs[2, :bucket] = torch.arange(bucket, device=self.device)
        try:
            clear()
            eager = self._forward(bucket).clone()
            clear()
            self.graphs[bucket].replay()
            torch.cuda.synchronize(self.device)
            err = ((self.out[bucket] - eager).abs().max() / eager.abs().max().clamp_min(1e-30)).item()
        finally:
            clear()
            self.inputs[2] = self.slots.padding
        return "" if err <= REPLAY_TOLERANCE else f"a replay of the captured step differs from the step run uncaptured by {err:.1e} of its largest logit"

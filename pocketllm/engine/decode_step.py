"""The decode-step seam: what runs one sequence's decode row when the engine takes it straight to a
step instead of a whole pass. The layers keep one torch form each; a backend here makes their step
fast from outside them, with the same bits, and the engine's one shortcut (Engine.direct_step)
is the only caller. The backend is chosen here, once per set of bound kernels, and rank 0 prints
the choice.

A backend is a class built from the engine (`backend(engine)`: its model, slots and pass shape)
with a `why_not(model)` that says why it cannot run that model's step ("" when it can, None when
it is for another kind of device), and two
calls per token of one sequence: `logits(token, pos, slot) -> fp32 [vocab]` and `greedy(token,
pos, slot) -> int` (the argmax of those logits, torch.argmax's choice); a backend that runs
several sequences' rows at once also has `rows(tokens, positions, slots) -> fp32 [n, vocab]`. On a
CUDA device the backend is the step captured as CUDA graphs; on a CPU, the compiled C step."""

from __future__ import annotations

from dataclasses import dataclass

from pocketllm.models.compiled_step import CompiledStep
from pocketllm.models.graph_step import ENV_GRAPH, GraphStep

# Tried in order; the first that can run the model's step is taken. (name, class)
BACKENDS = (("cuda graph", GraphStep), ("one compiled call", CompiledStep))


@dataclass
class StepChoice:
    """The chosen backend, built for the model (None: every decode row runs the layers' path), and
    what it is, or why none could be taken."""

    backend: object | None
    name: str
    note: str = ""

    def describe(self) -> str:
        """The line rank 0 prints."""
        if self.backend is None:
            return f"decode step: layer by layer ({self.note})"
        return f"decode step: {self.backend.describe() if hasattr(self.backend, 'describe') else self.name}"


def first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def without(choice: StepChoice) -> str:
    """How a run goes without the choice's backend, where a switch says it ("" where none does)."""
    return f" ({ENV_GRAPH}=0 runs the layers' path)" if choice.name == "cuda graph" else ""


def failed(choice: StepChoice, exc: Exception) -> StepChoice:
    """The layers' path after `choice`'s backend failed to get ready (its exception's first line)."""
    return StepChoice(None, "layer by layer", f"{choice.name} failed: {type(exc).__name__}: {first_line(exc)}".rstrip(": "))


def choose(engine) -> StepChoice:
    """The first backend that can run the engine's model's decode step, built; else why none can."""
    notes = []
    for name, backend in BACKENDS:
        why = backend.why_not(engine.model)
        if why == "":
            return StepChoice(backend(engine), name)
        if why is not None:  # None: a backend for another kind of device
            notes.append(why)
    return StepChoice(None, "layer by layer", "; ".join(notes) or "no step backend for this device")

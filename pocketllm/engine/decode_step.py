"""The decode-step seam: what runs one sequence's decode row when the engine takes it straight to a
step instead of a whole pass. The layers keep one torch form each; a backend here makes their step
fast from outside them, with the same bits, and the engine's one shortcut (Engine.direct_step)
is the only caller. The backend is chosen here, once per set of bound kernels, and rank 0 prints
the choice.

A backend is a class built from the model (`backend(model)`) with a `why_not(model)` that says why
it cannot run that model's step ("" when it can), and two calls per token:
`logits(token, pos, states) -> fp32 [vocab]` and `greedy(token, pos, states) -> int` (the
argmax of those logits, torch.argmax's choice). On a CPU the backend is the compiled C step; a
device backend (a captured CUDA graph of the same step) goes beside it in BACKENDS."""

from __future__ import annotations

from dataclasses import dataclass

from pocketllm.models.compiled_step import CompiledStep

# Tried in order; the first that can run the model's step is taken. (name, class)
BACKENDS = (("one compiled call", CompiledStep),)


@dataclass
class StepChoice:
    """The chosen backend, built for the model (None: every decode row runs the layers' path), and
    what it is, or why none could be taken."""

    backend: object | None
    name: str
    note: str = ""

    def describe(self) -> str:
        """The line rank 0 prints."""
        return f"decode step: {self.name}" if self.backend is not None else f"decode step: layer by layer ({self.note})"


def choose(model) -> StepChoice:
    """The first backend that can run the model's decode step, built; else why none can."""
    notes = []
    for name, backend in BACKENDS:
        why = backend.why_not(model)
        if not why:
            return StepChoice(backend(model), name)
        notes.append(why)
    return StepChoice(None, "layer by layer", "; ".join(notes))

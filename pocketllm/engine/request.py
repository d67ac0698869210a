"""A request as the scheduler runs it (its prompt, the tokens chosen, where it stands in its slot),
and the KV pool's use as /metrics reports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pocketllm.engine.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    output: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # a TokenLogprob per output token, when sampling.logprobs asks
    finished: bool = False
    finish_reason: str | None = None  # "stop" (a stop token), "length" (max_new_tokens), "cancelled", "error"
    error: str | None = None  # what ended it, when its finish_reason is "error" (one line)
    slot: int | None = None
    fed: int = 0  # positions of this sequence the engine has run
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()  # eos ids unless ignore_eos, and stop_token_ids
    preempted: int = 0  # times its blocks were taken back and it was recomputed
    prefix_counted: bool = False  # its prefix-cache hit or miss was counted (once: not again when readmitted)
    # Given (start, fp32 logits [rows, V]) for each span of prompt positions from `start` as the
    # passes read them (generate --logits-out, serve's prompt logprobs: sampling.PromptLogprobs);
    # None: only each pass's last rows are computed. Such a request reads its whole prompt (no
    # cached prefix), again after a preemption.
    prompt_logits: Callable[[int, torch.Tensor], None] | None = None

    def tokens(self, end: int) -> list[int]:
        """Its first `end` positions' ids: the prompt, then the tokens chosen."""
        n = len(self.prompt)
        return self.prompt[:end] + self.output[: max(end - n, 0)]

    @property
    def length(self) -> int:
        """Positions the sequence has: its prompt and the tokens chosen so far."""
        return len(self.prompt) + len(self.output)

    def prefilling(self, invariant: bool) -> bool:
        """Its next rows are a chunk of what it already has, not decode rows: of its prompt
        (batch-invariant), or of its prompt and tokens so far (after a preemption, otherwise)."""
        return self.fed < (len(self.prompt) if invariant else max(len(self.prompt), self.length - 1))

    def ids(self, start: int, end: int) -> list[int]:
        """The ids of its positions start..end-1."""
        n = len(self.prompt)
        return self.prompt[start : min(end, n)] + self.output[max(start - n, 0) : max(end - n, 0)]

    def _next_rows(self, budget: int) -> list[int]:
        """The ids this sequence feeds to its next pass: a chunk of its positions within
        `budget`, or its last token (POCKETLLM_BATCH_INVARIANT=0)."""
        end = min(self.length, self.fed + budget) if self.prefilling(False) else self.fed + 1
        return self.ids(self.fed, end)


@dataclass
class KVUsage:
    """The KV pool and the prefix cache as /metrics reports them."""

    blocks_total: int
    blocks_used: int  # held by running requests
    block_size: int
    preemptions: int
    prefix_caching: bool = False
    prefix_hits: int = 0  # requests started from a cached prefix
    prefix_misses: int = 0
    prefix_hit_tokens: int = 0  # positions they did not run
    prefix_entries: int = 0
    prefix_blocks: int = 0  # held by cached prefixes alone: given back when requests need them

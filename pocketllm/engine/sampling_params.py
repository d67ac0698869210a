"""What a request asks of the choice of its tokens (SamplingParams) and what it gets back per token
with logprobs (TokenLogprob): plain data, free of torch, so that the HTTP process of `serve`
builds and reads them without importing it."""

from __future__ import annotations

from dataclasses import dataclass

# Logprobs are reported for the chosen token and up to this many alternatives per position.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # stop tokens (eos, stop_token_ids) are masked until this many were generated
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none reported; N: the chosen token's and the N likeliest
    # None: none; N: every prompt token's after the first (under the logits of the position before
    # it) and the N likeliest there, as vLLM's prompt_logprobs (a completion's echo with logprobs).
    prompt_logprobs: int | None = None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or reads them: the argmax the scheduler
        takes for the whole batch at once is the token."""
        return self.temperature <= 0 and not self.changes_logits and self.logprobs is None

    @property
    def changes_logits(self) -> bool:
        return bool(self.min_tokens or self.logit_bias or self.repetition_penalty != 1.0
                    or self.presence_penalty or self.frequency_penalty)

    def stop_ids(self, eos_ids) -> frozenset[int]:
        """The tokens that end the sequence: the model's eos ids unless ignore_eos, and stop_token_ids."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))


@dataclass
class TokenLogprob:
    """The log-probability of a chosen token under the model's distribution (log_softmax of the
    raw logits), and the `n` likeliest tokens' at that position, likeliest first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]

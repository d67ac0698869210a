"""How one sequence's next token is chosen from its row of logits, with the sampling parameters of
OpenAI's API and vLLM's extensions, in vLLM's order: the raw logits' log-probabilities kept for
`logprobs`; stop tokens masked until `min_tokens`; `logit_bias` added; the repetition penalty over
prompt and output tokens, then the frequency and presence penalties over output tokens; then
greedy (argmax of what the penalties left) or temperature, min-p, top-k, top-p and a draw from
the request's own generator.

Every processor has a plain reference beside it with the same signature (`*_reference`), which
the tests compare it with."""

from __future__ import annotations

import math

import torch

from pocketllm.engine.sampling_params import MAX_LOGPROBS, SamplingParams, TokenLogprob  # noqa: F401  (re-exported)


def choose(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], eos_ids,
           gen: torch.Generator) -> tuple[int, TokenLogprob | None]:
    """The next token after prompt + output from one row of logits [V], and its logprob when
    params.logprobs asks for it."""
    raw = logits.float().cpu()
    logprobs = torch.log_softmax(raw, dim=-1) if params.logprobs is not None else None
    if params.changes_logits:
        raw = raw.clone()
        if len(output) < params.min_tokens:
            mask_tokens_(raw, sorted(params.stop_ids(eos_ids)))
        if params.logit_bias:
            add_logit_bias_(raw, params.logit_bias)
        apply_penalties_(raw, prompt, output, params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    token = sample_token(raw, params, gen)
    if logprobs is None:
        return token, None
    top = []
    if params.logprobs > 0:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = list(zip(ids.tolist(), values.tolist()))
    return token, TokenLogprob(token, float(logprobs[token]), top)


# Rows of a prompt's logits turned into logprobs at a time: the fp32 log_softmax of a pass's every
# row at once would be another copy of its logits (1 MB a row at a 248k vocabulary).
PROMPT_LOGPROB_ROWS = 64


def prompt_logprobs(logits: torch.Tensor, following: list[int], n: int) -> list[TokenLogprob]:
    """For each row of logits [rows, V], the logprob of the token that follows it in the prompt
    (following[i] for row i) under the row's raw log_softmax, and the n likeliest there. Computed
    where the logits are (a device's): only those few values a row come to the host."""
    out = []
    for r in range(0, len(following), PROMPT_LOGPROB_ROWS):
        logprobs = torch.log_softmax(logits[r : r + PROMPT_LOGPROB_ROWS].float(), dim=-1)
        block = following[r : r + PROMPT_LOGPROB_ROWS]
        targets = torch.tensor(block, dtype=torch.long, device=logprobs.device).view(-1, 1)
        chosen = logprobs.gather(1, targets).view(-1).tolist()
        tops = [[] for _ in block]
        if n > 0:
            values, ids = torch.topk(logprobs, n, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        out += [TokenLogprob(t, lp, top) for t, lp, top in zip(block, chosen, tops)]
    return out


class PromptLogprobs:
    """A request's prompt_logits reader (Request.prompt_logits) that keeps vLLM's prompt_logprobs:
    for each prompt position p >= 1, prompt[p]'s logprob under the logits of position p - 1, and
    the n likeliest there. Kept by position, so rows a preemption reads again refill them alike."""

    def __init__(self, prompt: list[int], n: int):
        self.prompt, self.n = list(prompt), n
        self.scored: dict[int, TokenLogprob] = {}

    def __call__(self, start: int, rows: torch.Tensor) -> None:
        # Row i reads the logits prompt[start + i + 1] is scored under; the last prompt row's
        # choose the first new token instead.
        n = min(len(rows), len(self.prompt) - 1 - start)
        if n > 0:
            self.scored.update(zip(range(start + 1, start + 1 + n), prompt_logprobs(rows[:n], self.prompt[start + 1 : start + 1 + n], self.n)))

    def listed(self) -> list[TokenLogprob | None]:
        """One per prompt position, the first None (nothing comes before it)."""
        return [None] + [self.scored.get(p) for p in range(1, len(self.prompt))]


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """A token drawn from one row of logits [V] by temperature, min-p, top-k and top-p (greedy at
    temperature 0, which ignores the other three), with `gen` as the only source of randomness."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if math.isnan(float(probs[0])):
        # A logit of +inf (a repetition penalty near 0), finite logits over a temperature so small
        # that they overflow, or every logit -inf: the softmax's max is then not finite and every
        # entry comes out NaN, so one entry says it. Its limit is what is drawn from instead.
        probs = likeliest(logits)
        if probs is None:
            return int(torch.argmax(logits))  # every token masked: nothing a draw could honour
    ids = None
    # Top-k first, which leaves k candidates for the rest to work on: min-p's threshold is relative
    # to the likeliest token, which is among them, so the order does not change the outcome.
    if 0 < params.top_k < probs.shape[0]:
        probs, ids = top_k_filter(probs, params.top_k)
    if params.min_p > 0:
        probs = min_p_filter(probs, params.min_p)
    if ids is not None or params.min_p > 0:
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    drawn = draw(probs, gen)
    return drawn if ids is None else int(ids[drawn])


def likeliest(logits: torch.Tensor) -> torch.Tensor | None:
    """The limit of softmax(logits / T) as T falls to 0, where the softmax itself overflows: the
    likeliest tokens (those at the largest logit, +inf included), equally likely; None when no
    token has a logit above -inf (a NaN logit counts as -inf)."""
    x = torch.nan_to_num(logits.float().cpu(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = x.max()
    if top == float("-inf"):
        return None
    return (x == top).float()


def likeliest_reference(logits: torch.Tensor) -> torch.Tensor | None:
    values = [v if v == v else float("-inf") for v in logits.float().tolist()]
    top = max(values)
    return None if top == float("-inf") else torch.tensor([1.0 if v == top else 0.0 for v in values])


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One index drawn from probs [V] (non-negative, any positive sum) by inverting its cumulative
    sum at one uniform number from `gen`: torch.multinomial over a whole vocabulary row cost many
    times as much, a large share of a decode step of several sequences (docs/serving.md)."""
    cum = torch.cumsum(probs.double(), dim=0)
    at = float(torch.rand((), dtype=torch.float64, generator=gen)) * float(cum[-1])
    # The first index whose cumulative sum passes `at`: never a zero-probability one (its sum
    # equals the one before it). Rounding can put `at` on the total: then the last likely index.
    i = int(torch.searchsorted(cum, torch.tensor([at], dtype=torch.float64), right=True))
    return i if i < probs.shape[0] else int(torch.nonzero(probs > 0)[-1])


def draw_reference(probs: torch.Tensor, gen: torch.Generator) -> int:
    at = float(torch.rand((), dtype=torch.float64, generator=gen)) * sum(float(p) for p in probs.double())
    total = 0.0
    for i, p in enumerate(probs.double().tolist()):
        total += p
        if total > at:
            return i
    return max(i for i, p in enumerate(probs.tolist()) if p > 0)


def mask_tokens_(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """logits [V] with the given token ids made impossible, in place."""
    if ids:
        logits[torch.tensor(ids, dtype=torch.long)] = float("-inf")
    return logits


def add_logit_bias_(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """logits [V] plus a bias per token id, in place."""
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
    logits.index_add_(0, ids, torch.tensor([b for _, b in bias], dtype=logits.dtype))
    return logits


def apply_penalties_(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float, frequency: float,
                     presence: float) -> torch.Tensor:
    """logits [V], in place: a token seen in the prompt or the output has its logit divided by
    `repetition` when positive, multiplied when negative; then each output token's logit loses
    `frequency` per time it was generated and `presence` once if it was."""
    vocab = logits.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab) if output else torch.zeros(vocab, dtype=torch.long)
    if repetition != 1.0:
        seen = counts > 0
        if prompt:
            seen[torch.tensor(prompt, dtype=torch.long)] = True
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
    if frequency:
        logits -= frequency * counts.to(logits.dtype)
    if presence:
        logits -= presence * (counts > 0).to(logits.dtype)
    return logits


def apply_penalties_reference(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float, frequency: float,
                              presence: float) -> torch.Tensor:
    for t in set(prompt) | set(output):
        x = float(logits[t])
        logits[t] = x / repetition if x > 0 else x * repetition
    for t in set(output):
        logits[t] -= frequency * output.count(t) + presence
    return logits


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """probs [V] with every token less likely than min_p times the likeliest one zeroed."""
    return torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)


def min_p_filter_reference(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    top = max(probs.tolist())
    return torch.tensor([p if p >= min_p * top else 0.0 for p in probs.tolist()], dtype=probs.dtype)


def top_k_filter(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of probs [V]: their probabilities [k], likeliest first, and ids [k]."""
    return torch.topk(probs, k)


def top_k_filter_reference(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = sorted(range(probs.shape[0]), key=lambda i: -float(probs[i]))[:k]
    return probs[order], torch.tensor(order, dtype=torch.long)


# The likeliest tokens a nucleus is first looked for among, and the factor their count grows by
# while their mass is under top_p: a nucleus is usually a few dozen tokens, and sorting a whole
# vocabulary row on the host (248k at the 27B's) cost 20 ms a token a request. Past a quarter of
# the row the whole row is sorted: a top-k that large costs more than the sort.
NUCLEUS_FIRST, NUCLEUS_GROWTH = 128, 8


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [V] with only the nucleus kept: the likeliest tokens whose mass before each is under
    top_p (so at least one). Found among the k likeliest, k growing until their mass reaches
    top_p: every token after them has at least that much before it, so none would be kept (which
    of several equally likely tokens at its edge is kept is the top-k's or the sort's choice)."""
    v = probs.shape[0]
    k = min(NUCLEUS_FIRST, v)
    while True:
        sorted_probs, order = torch.topk(probs, k) if k < v else torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        if k == v or float(cum[-1]) >= top_p:
            break
        k = k * NUCLEUS_GROWTH if k * NUCLEUS_GROWTH * 4 < v else v
    keep = cum - sorted_probs < top_p
    # The likeliest always: a top_p below float32's least value (1e-46) compares as 0 there, and
    # kept nothing to draw from.
    keep[0] = True
    return torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])


def top_p_filter_reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    out = torch.zeros_like(probs)
    mass = 0.0
    for i in sorted(range(probs.shape[0]), key=lambda i: -float(probs[i])):
        if mass >= top_p:
            break
        out[i] = probs[i]
        mass += float(probs[i])
    return out

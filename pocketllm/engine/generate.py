"""Token generation: greedy or temperature/top-p sampling. Every rank feeds the same token to the
next step: a sampled token is drawn on rank 0 and broadcast, a greedy one is the argmax of logits
every rank holds alike."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pocketllm.distributed.state import broadcast_, tp
from pocketllm.engine.runner import Engine
from pocketllm.engine.sampling import SamplingParams, sample_token


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator().manual_seed(params.seed)
        self._token: torch.Tensor | None = None

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0

    def __call__(self, logits: torch.Tensor) -> int:
        if self.greedy:
            # Every rank holds the same logits, bit for bit (the head's parts are gathered, not
            # computed per rank), so every rank's argmax is the same token: no broadcast, which
            # on gloo costs a loopback round trip per token. Greedy stays on the device: only the
            # chosen id crosses to the host, not the vocab row.
            return int(torch.argmax(logits))
        # The broadcast buffer lives on the logits' device (NCCL/HCCL broadcast device tensors),
        # and the token is read back from that same buffer.
        if self._token is None or self._token.device != logits.device:
            self._token = torch.zeros(1, dtype=torch.long, device=logits.device)
        if tp().rank == 0:
            self._token.fill_(sample_token(logits, self.params, self.gen))
        broadcast_(self._token)
        return int(self._token.item())


def generate(
    engine: Engine,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: tuple[int, ...] = (),
    prompt_logits: Callable[[torch.Tensor], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Prefill the prompt, then decode up to max_new_tokens, stopping after an eos id.
    prompt_logits, when given, receives every prompt position's logits [T, V] from that same
    prefill; their last row is the one-row head's, so the tokens are those of a run without it.
    on_token, when given, receives each token as soon as it is chosen, before the step that feeds
    it (on every rank)."""
    # One sequence is one slot of the engine's passes.
    engine.reserve_slots(1, len(prompt) + max_new_tokens)
    sampler = Sampler(sampling)
    ids = torch.tensor(prompt, dtype=torch.long)
    if prompt_logits is None:
        logits = engine.run_packed([(0, 0, ids)])[0]
    else:
        every = engine.run_packed([(0, 0, ids)], all_logits=True)
        prompt_logits(every)
        logits = every[-1]
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    pos = len(prompt)
    token = sampler(logits)
    while True:
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_ids or len(out) == max_new_tokens:
            break
        # Greedy, the engine finds the argmax itself (in the compiled step where it runs).
        if sampler.greedy:
            token = engine.greedy_row(0, pos, token)
        else:
            token = sampler(engine.run_packed([(0, pos, torch.tensor([token], dtype=torch.long))])[0])
        pos += 1
    return out

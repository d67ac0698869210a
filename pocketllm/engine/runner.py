"""The resident engine on one rank: the model with its weights loaded, its decode state, the slice
policy, and the two passes every command is made of, prefill and decode."""

from __future__ import annotations

import torch

from pocketllm.config import ModelConfig
from pocketllm.distributed.accounting import COUNTER
from pocketllm.distributed.policy import SlicePolicy
from pocketllm.engine.cache import allocate_states, reset_states
from pocketllm.loader.load import load_weights
from pocketllm.models.qwen3_5 import Qwen35ForCausalLM


class Engine:
    def __init__(self, cfg: ModelConfig, source, dtype: torch.dtype, device: torch.device, policy: SlicePolicy):
        self.cfg, self.dtype, self.device, self.policy = cfg, dtype, device, policy
        self.model = Qwen35ForCausalLM(cfg, dtype, device)
        self.loaded_bytes = load_weights(self.model, source)
        source.close()
        self.states: list = []
        self.capacity = 0
        self.pos = 0
        # All-reduces the last pass issued, per site.
        self.last_collectives: dict[str, int] = {}
        self.last_slices = 1

    def start_sequence(self, max_len: int) -> None:
        """Make room for max_len positions and forget any previous sequence."""
        if max_len > self.capacity:
            self.states = allocate_states(self.model, max_len)
            self.capacity = max_len
        else:
            reset_states(self.states)
        self.pos = 0

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, decode: bool, all_logits: bool = False) -> torch.Tensor:
        rows = ids.shape[0]
        if self.pos + rows > self.capacity:
            raise RuntimeError(f"sequence of {self.pos + rows} positions exceeds the {self.capacity} allocated")
        self.last_slices = self.policy.slices_for_rows(rows)
        ctx = self.model.context(self.pos, rows, self.last_slices, decode)
        COUNTER.reset()
        logits = self.model(ids.to(self.device), ctx, self.states, all_logits=all_logits)
        self.last_collectives = COUNTER.snapshot()
        self.pos += rows
        return logits

    def prefill(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """ids [T] -> fp32 logits of the last position [V] (every position [T, V] with all_logits)."""
        return self._run(ids, decode=False, all_logits=all_logits)

    def decode(self, token: int) -> torch.Tensor:
        return self._run(torch.tensor([token], dtype=torch.long), decode=True)

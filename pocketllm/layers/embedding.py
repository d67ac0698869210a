"""Vocab-parallel embedding and LM head. The vocab is padded to a multiple of the world size; each
rank holds one contiguous block of rows, the padding rows stay zero and their logits are dropped."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.distributed.state import all_gather_cat, all_reduce_, tp
from pocketllm.layers.linear import project
from pocketllm.layers.sharding import QuantSource, ShardSource, quantized_param, read_rows, sharded_param
from pocketllm.ops.registry import default_kernels
from pocketllm.quantization import WeightPlan


def vocab_block(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, end, rows per rank) of this rank's block of the padded vocab."""
    per_rank = -(-vocab // world)
    return rank * per_rank, (rank + 1) * per_rank, per_rank


def _vocab_param(key: str, vocab: int, hidden: int, dtype, device) -> tuple[nn.Parameter, int, int]:
    start, end, per_rank = vocab_block(vocab, tp().rank, tp().world)
    real_end = min(end, vocab)
    sources = []
    if real_end > start:
        sources.append(ShardSource(key, (vocab, hidden), read_rows([(start, real_end)]), (0, real_end - start)))
    return sharded_param((per_rank, hidden), sources, dtype, device), start, end


class VocabParallelEmbedding(nn.Module):
    def __init__(self, key: str, vocab: int, hidden: int, dtype, device):
        super().__init__()
        self.weight, self.start, self.end = _vocab_param(key, vocab, hidden, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp().world == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        all_reduce_(out, "embed")
        return out


class ParallelLMHead(nn.Module):
    """Logits for the given rows, gathered over ranks and trimmed to the real vocab. Tied heads
    share the embedding's shard (unquantized, as the embedding is); untied ones load
    `lm_head.weight` the same way, quantized where the weight plan says so."""

    def __init__(
        self, key: str | None, vocab: int, hidden: int, dtype, device, tied_to: VocabParallelEmbedding | None, plan: WeightPlan | None = None
    ):
        super().__init__()
        self.vocab = vocab
        scheme = None if tied_to is not None or plan is None else plan.scheme_for(key)
        if tied_to is not None:
            self.weight = tied_to.weight
        elif scheme is None:
            self.weight, _, _ = _vocab_param(key, vocab, hidden, dtype, device)
        else:
            start, end, per_rank = vocab_block(vocab, tp().rank, tp().world)
            real_end = min(end, vocab)
            # Padding rows stay zero: their logits are dropped.
            sources = [QuantSource(key, (vocab, hidden), ((start, real_end),), None, (0, real_end - start))] if real_end > start else []
            self.weight = quantized_param((per_rank, hidden), scheme, sources, dtype, device)
        self.kernels = default_kernels(self.weight)

    def after_loading(self) -> None:
        # The loader may have replaced a quantized weight (by its dequantized values on a device).
        self.kernels = default_kernels(self.weight)

    def forward(self, h: torch.Tensor, parts=None) -> torch.Tensor:
        """parts (layers.context.Part): the rows' calls, as a projection's (None: one call)."""
        logits = project(self.kernels, h, parts).float()
        return all_gather_cat(logits)[..., : self.vocab]

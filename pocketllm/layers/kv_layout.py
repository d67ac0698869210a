"""The paged KV cache's arithmetic: positions per block, the KV heads each rank holds and the bytes
a block takes on it. Torch-free: `pocketllm serve`'s launcher sizes --kv-cache-gib with it before
it starts a rank."""

from __future__ import annotations

from pocketllm.config import FULL, LINEAR, ModelConfig

# Positions per KV block. 64 rows of one head (D=256, bf16) are 32 KiB contiguous, a unit a decode
# kernel can stream per head and split over; it divides the scheduler's prefill chunks and the
# gated delta rule's 64-row chunks, so a chunk boundary is a block boundary (where a prefix cache
# can share whole blocks); a sequence wastes at most 63 rows in its last block.
KV_BLOCK_SIZE = 64


def blocks_for(positions: int, block_size: int = KV_BLOCK_SIZE) -> int:
    return -(-positions // block_size)


def kv_head_range(num_kv: int, rank: int, world: int) -> tuple[int, int]:
    """KV heads this rank holds. With fewer KV heads than ranks each head is replicated on
    world // num_kv consecutive ranks, which are exactly the ranks whose query heads read it."""
    if num_kv >= world:
        per = num_kv // world
        return rank * per, (rank + 1) * per
    head = rank // (world // num_kv)
    return head, head + 1


def kv_block_bytes(cfg: ModelConfig, world: int, elem_size: int, block_size: int = KV_BLOCK_SIZE) -> int:
    """Bytes one KV block takes on each rank, K and V of every full-attention layer."""
    kv0, kv1 = kv_head_range(cfg.num_key_value_heads, 0, world)
    layers = sum(1 for t in cfg.layer_types if t == FULL)
    return 2 * layers * (kv1 - kv0) * block_size * cfg.head_dim * elem_size


def gdn_slot_bytes(cfg: ModelConfig, world: int, elem_size: int) -> int:
    """Bytes one sequence's slot of linear-attention state takes on each rank: every such layer's
    conv tail (in the weights' dtype) and fp32 recurrent state, the heads split evenly over the
    ranks. serve holds --max-running + 1 slots of it beside the KV pool."""
    hk, hv = cfg.linear_num_key_heads // world, cfg.linear_num_value_heads // world
    channels = 2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim
    per_layer = (cfg.linear_conv_kernel_dim - 1) * channels * elem_size + hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return per_layer * sum(1 for t in cfg.layer_types if t == LINEAR)

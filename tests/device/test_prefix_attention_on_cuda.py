"""Rows going on from a cached prefix (a prompt after a prefix cache hit, a prompt's later chunks)
on CUDA, at the 27B's heads (24 query heads over 4 KV heads of 256) in bf16: their attention
(pocketllm/layers/paged_attention.attention_core) runs on the flash kernel, which takes the
bottom-right-aligned causal bias with GQA, not on the math kernel an explicit mask sends them to;
and gives what the explicit mask gives on the CPU. tests/test_attention_decode.py checks the same
bias against the explicit mask on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from device_caps import cuda_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numerics import rel_err  # noqa: E402
from pocketllm.layers.paged_attention import attention_core  # noqa: E402

pytestmark = pytest.mark.skipif(cuda_count() < 1, reason="needs 1 cuda device(s)")


def test_rows_after_a_prefix_take_the_flash_kernel_and_the_cpus_answer():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(40)
    start, t, d = 3000, 500, 256
    q = torch.randn(24, t, d, generator=g).bfloat16()
    keys, values = (torch.randn(4, start + t, d, generator=g).bfloat16() for _ in range(2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises where flash cannot take the call
        mine = attention_core(q.cuda(), keys.cuda(), values.cuda(), start, d**-0.5).cpu()
    theirs = attention_core(q.float(), keys.float(), values.float(), start, d**-0.5)
    assert rel_err(mine.float(), theirs) <= 2**-7

"""Weights on huge pages: host_memory.zeros behaves as torch.zeros, its mapping is advised for
transparent huge pages and starts on a huge-page boundary, lives as long as any view of it, and is
unmapped after; an engine loaded onto such mappings still matches transformers. And a large
activation block comes from a heap that keeps it, once keep_freed_blocks has told glibc so."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conftest import feed
from hf_oracle import build_hf_model, hf_prefill_logits, save_hf_checkpoint
from pocketllm import host_memory

THP_BUILT = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def mapping_of(t: torch.Tensor, last: bool = False) -> tuple[str, list[str]] | None:
    """(address range, VmFlags) of the mapping in /proc/self/smaps that holds t's first byte (or
    its last)."""
    addr = t.data_ptr() + (t.numel() * t.element_size() - 1 if last else 0)
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            current = head if lo <= addr < hi else None
        elif head == "VmFlags:" and current:
            return current, line.split()[1:]
    return None


SHAPE = (1500, 1024)  # 2.9 MiB in bf16: more than one huge page, not a whole number of them


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large_cpu_zeros_are_zeros_on_an_aligned_mapping(dtype):
    t = host_memory.zeros(SHAPE, dtype)
    assert t.shape == SHAPE and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert not t.any()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    # Its storage is the whole mapping, a huge page of slack larger than the tensor.
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size() + host_memory.HUGE_PAGE
    t.fill_(3)
    assert bool((t == 3).all())


@pytest.mark.skipif(not THP_BUILT, reason="kernel built without transparent huge pages: madvise(MADV_HUGEPAGE) is refused")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large_cpu_zeros_advise_whole_huge_pages_only(dtype):
    t = host_memory.zeros(SHAPE, dtype)
    head = mapping_of(t)
    assert head is not None
    assert "hg" in head[1], f"mapping {head[0]} not advised for huge pages: {head[1]}"
    # The tail short of a whole huge page is not advised: a huge page there would cover slack.
    tail = mapping_of(t, last=True)
    assert tail is not None and tail[0] != head[0] and "hg" not in tail[1], tail


def test_small_or_non_cpu_requests_are_plain_torch_zeros():
    small = host_memory.zeros((64, 64), torch.float32)
    assert not small.any() and small.shape == (64, 64) and small.dtype == torch.float32
    # torch.zeros gives a storage of exactly the tensor's bytes; a mapping from host_memory's own
    # path would be the tensor plus a huge page of slack (see the large-tensor test).
    assert small.untyped_storage().nbytes() == small.numel() * small.element_size() == 64 * 64 * 4
    meta = host_memory.zeros((4096, 4096), torch.float32, "meta")
    assert meta.is_meta and meta.shape == (4096, 4096)


def mapped(addr: int) -> bool:
    """Whether any mapping of this process holds addr (by containment: the kernel may merge an
    unadvised mapping with its neighbours, so its range string is not stable)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= addr < hi:
            return True
    return False


def test_mapping_lives_while_a_view_does_and_is_unmapped_after():
    t = host_memory.zeros((3 * 2**20,), torch.uint8)
    view = t[2**20 :]
    base = t.untyped_storage().data_ptr()  # the mapping's first byte, slack included
    del t
    gc.collect()
    view.fill_(7)
    assert int(view[-1]) == 7 and mapped(base)
    del view
    gc.collect()
    assert not mapped(base)


def test_an_arenas_tensors_are_aligned_on_one_mapping_that_goes_with_the_last_of_them():
    a, b = torch.arange(10, dtype=torch.float32).view(2, 5), torch.arange(7, dtype=torch.bfloat16)
    arena = host_memory.Arena(host_memory.Arena.room([a, b]))
    x, y = arena.like(a).copy_(a), arena.like(b).copy_(b)
    assert torch.equal(x, a) and torch.equal(y, b) and (x.shape, y.dtype) == (a.shape, b.dtype)
    assert x.data_ptr() % 64 == y.data_ptr() % 64 == 0 and y.data_ptr() > x.data_ptr()
    with pytest.raises(ValueError, match="the arena holds"):
        arena.like(torch.empty(100))
    base = arena.raw.untyped_storage().data_ptr()
    del arena, x
    gc.collect()
    assert mapped(base) and torch.equal(y, b)
    del y
    gc.collect()
    assert not mapped(base)


def test_engine_on_huge_pages_matches_transformers(tmp_path):
    # vocab 8300 x hidden 64 in fp32 is 2.1 MB: the embedding and the head take the huge-page path.
    from pocketllm.config import load_config
    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.loader.checkpoint import CheckpointReader

    model = build_hf_model(vocab=8300, kv_heads=2, tie=False, seed=5)
    ckpt = save_hf_checkpoint(model, tmp_path / "ckpt")
    prompt = [(31 * i + 7) % 8300 for i in range(40)]
    set_tp(0, 1)
    engine = Engine(load_config(ckpt), CheckpointReader(str(ckpt)), torch.float32, torch.device("cpu"), RulePolicy())
    big = [p for p in engine.model.parameters() if p.numel() * p.element_size() >= host_memory.MIN_BYTES]
    assert len(big) == 2
    for p in big:
        assert p.data_ptr() % host_memory.HUGE_PAGE == 0
    engine.reserve_slots(1, len(prompt))
    logits = feed(engine, prompt, all_logits=True)
    torch.testing.assert_close(logits.float(), hf_prefill_logits(model, prompt), atol=2e-4, rtol=1e-3)


# In a fresh process (glibc's settings are the process's, and any engine built earlier in this one
# has set them): where a 64 MiB block, over glibc's 32 MiB mapping threshold, comes from before and
# after pocketllm's keep_freed_blocks (which an engine on a CPU calls), and whether freeing it gives
# the memory back to the system.
WHERE_A_LARGE_BLOCK_LIVES = """
import sys, torch
from pocketllm.host_memory import keep_freed_blocks

def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            return lo, hi
    return 0, 0

def block():
    t = torch.ones(64 * 2**20, dtype=torch.uint8)
    lo, hi = heap()
    inside = lo <= t.data_ptr() < hi
    del t
    return inside, heap()[1] - hi

plain = block()
applied = keep_freed_blocks({})
kept = block()
print(*plain, applied, *kept)
# Without the interpreter's teardown of torch (conftest.end_process says why).
sys.stdout.flush()
import os
os._exit(0)
"""


def test_keep_freed_blocks_serves_large_blocks_from_a_heap_that_keeps_them():
    import subprocess
    import sys

    from conftest import cli_env
    from pocketllm.errors import UsageError
    from pocketllm.host_memory import keep_freed_blocks

    assert keep_freed_blocks({"POCKETLLM_KEEP_FREED": "0"}) is False
    with pytest.raises(UsageError, match="POCKETLLM_KEEP_FREED"):
        keep_freed_blocks({"POCKETLLM_KEEP_FREED": "maybe"})
    r = subprocess.run([sys.executable, "-c", WHERE_A_LARGE_BLOCK_LIVES], capture_output=True, text=True, timeout=60, env=cli_env())
    assert r.returncode == 0, r.stderr
    plain_inside, _, applied, kept_inside, kept_shrink = r.stdout.split()
    # glibc's default maps such a block on its own (and unmaps it when freed: a page fault per
    # 4 KiB on every use); after the call it comes from the heap, which does not shrink when it
    # is freed, so the next pass finds the memory already there.
    assert (plain_inside, applied, kept_inside, kept_shrink) == ("False", "True", "True", "0"), r.stdout


# A fresh process (torch reads the caches' bounds once, at its first bf16 GEMM): an engine on the
# tiny preset in bf16, its many-row projections on torch's GEMM (oneDNN's, where torch has it),
# fed prompts of every length from 1 to 100, each pass a row count not seen before; its resident
# memory after the 30th and the 100th, and the bounds in force.
PROMPTS_OF_EVERY_LENGTH = """
import os, sys, torch
from pocketllm.distributed.policy import RulePolicy
from pocketllm.distributed.state import set_tp
from pocketllm.engine.generate import generate
from pocketllm.engine.runner import Engine
from pocketllm.loader.random_weights import RandomWeights
from pocketllm.presets import get_preset

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10

set_tp(0, 1)
cfg = get_preset("tiny")
engine = Engine(cfg, RandomWeights(cfg, dtype=torch.bfloat16), torch.bfloat16, torch.device("cpu"), RulePolicy())
marks = []
for n in range(1, 101):
    generate(engine, [(7 * i + n) % 100 for i in range(n)], 1)
    if n in (30, 100):
        marks.append(rss_mb())
print(*marks, os.environ.get("LRU_CACHE_CAPACITY", "unset"), os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "unset"))
sys.stdout.flush()
os._exit(0)
"""


def test_an_engine_fed_prompts_of_every_length_stays_within_its_gemm_caches_bound():
    import subprocess
    import sys

    from conftest import cli_env

    env = cli_env(POCKETLLM_KERNELS="many-row=mm")
    for name in host_memory.GEMM_CACHES:
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", PROMPTS_OF_EVERY_LENGTH], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    at_30, at_100, lru, onednn = r.stdout.split()
    # Unbounded, each new row count adds an entry per projection shape to each cache, ~1-2 MB a
    # pair: 70 more passes grew such a process by ~240 MB; bounded, the caches are full by the
    # 30th pass and memory stays where it was.
    assert int(at_100) - int(at_30) < 100, (at_30, at_100, lru, onednn)
    assert (lru, onednn) == (str(host_memory.GEMM_CACHE_ENTRIES),) * 2


def test_gemm_cache_bounds_a_user_set_are_kept_and_an_empty_cache_is_refused():
    from pocketllm.errors import UsageError

    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "4096"}
    assert host_memory.bound_gemm_caches(env) == {"LRU_CACHE_CAPACITY": str(host_memory.GEMM_CACHE_ENTRIES), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "4096"}
    for given in ("0", "-1"):
        with pytest.raises(UsageError, match=f"LRU_CACHE_CAPACITY={given}: .*at least 1 entry"):
            host_memory.bound_gemm_caches({"LRU_CACHE_CAPACITY": given})

"""KV memory on demand (fp32, tiny preset, in process at TP=1): a request waits until the KV
blocks of its prompt fit in the pool; when the pool runs out mid-generation the last admitted
request is preempted and recomputed, and every request still gets the tokens it gets alone
(greedy and seeded sampling); a pool that holds one sequence runs them one at a time; the other
ranks, fed rank 0's plans, take and free the same blocks; the pool's use reaches /metrics."""

from __future__ import annotations

import pytest
import torch
from conftest import follow_in_process, tiny_engine, usage_error_in_process

from pocketllm.engine.generate import SamplingParams, generate
from pocketllm.engine.request import KVUsage
from pocketllm.engine.scheduler import Scheduler
from pocketllm.layers.kv_layout import KV_BLOCK_SIZE, blocks_for
from pocketllm.serving.metrics import Metrics, parse

torch.set_num_threads(2)

# With 64-position blocks: 60 grows past a block boundary while it decodes, 130 holds three
# blocks, 5 one, 70 two.
LENGTHS = (60, 130, 5, 70)
NEW = 10
MAX_LEN = max(LENGTHS) + NEW
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def prompts():
    return [[(29 * i + 11 * j + 5) % 1000 for i in range(n)] for j, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def alone(engine, prompts):
    return {name: [generate(engine, p, NEW, params) for p in prompts] for name, params in (("greedy", SamplingParams()), ("sampled", SAMPLED))}


def run_all(sched: Scheduler, prompts, params=SamplingParams()) -> tuple[list, list[int]]:
    """Every prompt through the scheduler; the requests, and the running count after each step."""
    requests = [sched.submit(p, NEW, params) for p in prompts]
    running = []
    while sched.has_work:
        sched.step()
        running.append(sched.num_running)
    return requests, running


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_short_pool_admits_by_blocks_and_preempts_without_changing_tokens(engine, prompts, alone, kind):
    assert KV_BLOCK_SIZE == 64  # the lengths above are chosen for it
    sched = Scheduler(engine, max_running=4, max_len=MAX_LEN, kv_blocks=4)
    assert sched.slots.blocks.num_blocks == 4
    requests = [sched.submit(p, NEW, SAMPLED if kind == "sampled" else SamplingParams()) for p in prompts]
    sched.step()
    # 60 (1 block) and 130 (3) fill the pool: 5 waits for blocks though two slots are free.
    assert [r.prompt for r in sched.running] == prompts[:2] and len(sched.free_slots) == 2
    assert sched.slots.blocks.num_used == 4
    preempted_with_tokens = False
    while sched.has_work:
        before = {r.id: len(r.output) for r in sched.running}
        sched.step()
        preempted_with_tokens |= any(r.slot is None and not r.finished and before.get(r.id) for r in requests)
    # 60 decoding into its second block took 130's blocks, which had tokens to recompute.
    assert sched.preemptions >= 1 and preempted_with_tokens
    assert [r.output for r in requests] == alone[kind]
    assert all(r.finish_reason == "length" for r in requests)
    assert sched.slots.blocks.num_used == 0 and sorted(sched.free_slots) == [0, 1, 2, 3]


def test_a_pool_of_one_sequence_runs_them_one_at_a_time(engine, prompts, alone):
    long = [p for p in prompts if blocks_for(len(p) + NEW) == blocks_for(MAX_LEN)] * 3
    sched = Scheduler(engine, max_running=3, max_len=MAX_LEN, kv_blocks=blocks_for(MAX_LEN))
    requests, running = run_all(sched, long)
    assert max(running) == 1
    assert [r.output for r in requests] == [alone["greedy"][LENGTHS.index(len(p))] for p in long]


def test_an_engine_pass_past_the_pool_is_refused_and_a_pool_must_hold_one_sequence(engine, prompts):
    with pytest.raises(ValueError, match="cannot hold one sequence of 200 positions"):
        engine.reserve_slots(2, 200, kv_blocks=3)
    engine.reserve_slots(2, 200, kv_blocks=4)
    engine.run_packed([(0, 0, torch.tensor(prompts[1]))])
    with pytest.raises(RuntimeError, match="the KV pool has 1 free blocks of 4, a sequence of 130 positions needs 3 more"):
        engine.run_packed([(1, 0, torch.tensor(prompts[1]))])
    # A span from position 0 frees what its slot held first: the same slot can start again.
    engine.run_packed([(0, 0, torch.tensor(prompts[1]))])
    assert engine.slots.blocks.num_used == 3


def test_the_other_ranks_take_and_free_the_same_blocks(engine, prompts, alone, monkeypatch):
    # Through admissions, finishes and preemptions.
    follower = tiny_engine()
    follower.reserve_slots(4, MAX_LEN, 4)
    seen = follow_in_process(monkeypatch, engine, follower, 4)
    sched = Scheduler(engine, max_running=4, max_len=MAX_LEN, kv_blocks=4)
    requests, _ = run_all(sched, prompts)
    assert [r.output for r in requests] == alone["greedy"]
    assert sched.preemptions >= 1 and len(seen) >= len(prompts)


def test_pool_use_and_preemptions_reach_metrics():
    text = Metrics().render(2, 1, KVUsage(blocks_total=40, blocks_used=10, block_size=64, preemptions=3))
    m = parse(text)
    assert m["pocketllm_kv_cache_blocks_total"] == 40 and m["pocketllm_kv_cache_blocks_used"] == 10
    assert m["pocketllm_kv_cache_usage_ratio"] == 0.25 and m["pocketllm_preemptions_total"] == 3
    assert "64 positions each" in text


def test_a_kv_budget_below_one_sequence_is_a_usage_error(capsys, no_ranks, tiny_ckpt):
    serve = ("serve", "--ckpt", tiny_ckpt, "--max-len", 4096, "--dtype", "float32")
    usage_error_in_process(capsys, *serve, "--kv-cache-gib", "0", expect="--kv-cache-gib must be a number > 0, got 0.0")
    # The tiny preset's block is 16 KiB at TP=1 in fp32: 4096 positions need 64 of them, 1 MiB.
    usage_error_in_process(
        capsys, *serve, "--kv-cache-gib", "0.0009", expect=("holds fewer positions than one sequence of --max-len 4096", "at least 0.000977 GiB")
    )


def test_a_preempted_request_readmitted_is_counted_once_by_the_prefix_cache(engine, prompts):
    sched = Scheduler(engine, max_running=4, max_len=MAX_LEN, kv_blocks=4, prefix_cache_bytes=4 * engine.slots.sequence_bytes())
    for p in prompts:
        sched.submit(p, NEW, SamplingParams())
    while sched.has_work:
        sched.step()
    assert sched.preemptions >= 1
    assert sched.prefix.hits + sched.prefix.misses == len(prompts)


def test_a_devices_free_memory_counts_what_torchs_allocator_holds_unused(monkeypatch):
    """The driver counts memory torch's allocator keeps for reuse as taken; the pool's default
    budget counts it free (torch gives it back before an allocation fails), or a pool sized after
    the weights' temporaries were freed would come out smaller by them."""
    import torch

    from pocketllm.engine.slots import free_memory_bytes

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 50 * gib)
    assert free_memory_bytes(torch.device("cuda", 0)) == 13 * gib



@pytest.mark.parametrize("max_len", [64, 4096 + 66, 40960 + 1])
def test_every_slots_block_table_starts_16_byte_aligned(max_len):
    """A slot's table is a row of one tensor that the KV kernels take as a pointer; Triton
    compiles a pointer that is not a multiple of 16 apart, so a first request in a slot the
    warm-up did not use waited for a compile where the rows were not aligned."""
    from pocketllm.engine.kv_blocks import BlockAllocator

    blocks = BlockAllocator(8, 5, max_len, torch.device("cpu"))
    assert all(t.ids.data_ptr() % 16 == 0 for t in blocks.tables)
    assert blocks.ids[5].data_ptr() % 16 == 0  # the padding slot's

"""Prefix caching for the hybrid model (fp32, tiny preset, in process at TP=1). Batch-invariant (the
default): a prompt's chunk ends are cached, and a request whose prompt starts with one (a long
shared prompt, a chat's next turn) starts from it and gets bit for bit what a cold run computes;
where a request stopped after decode steps is not cached. With POCKETLLM_BATCH_INVARIANT=0 that is
cached too (a chat's next turn starts there). Either way the cache forgets the least recently used
prefix under its budget and gives cached blocks back before it preempts a running request; the
other ranks replay every cache operation; the counts reach /metrics."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import feed, follow_in_process, tiny_engine

from pocketllm import host_memory

from pocketllm.engine.generate import generate
from pocketllm.engine.pass_plan import EVICT, RESTORE, SNAPSHOT
from pocketllm.layers.kv_layout import blocks_for
from pocketllm.engine.prefix_cache import PrefixCache
from pocketllm.engine.request import KVUsage
from pocketllm.engine.scheduler import Scheduler
from pocketllm.serving.metrics import Metrics, parse

torch.set_num_threads(2)

NEW = 8
# The tests' prompt chunk: a block, so a few hundred tokens cross several chunk ends.
CHUNK = 64


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine()
    engine.prefill_chunk = CHUNK
    return engine


@pytest.fixture(scope="module")
def variant_engine():
    """POCKETLLM_BATCH_INVARIANT=0: prompts read in chunks of the pass budget, and where a
    request stopped cached too."""
    return tiny_engine(invariant=False)


def ids(n: int, seed: int) -> list[int]:
    return [(37 * i + 101 * seed + 13) % 1000 for i in range(n)]


def drain(sched: Scheduler, prompt: list[int]):
    req = sched.submit(prompt, NEW)
    while sched.has_work:
        sched.step()
    return req


def entries(engine, n: int) -> int:
    """A prefix cache budget of n entries."""
    return n * engine.slots.sequence_bytes()


@pytest.mark.parametrize("length", [107, 128], ids=["partial-block", "whole-blocks"])
def test_a_restored_slot_runs_on_exactly_as_the_cached_sequence(engine, length):
    # What a hit rests on: a slot started from a cached prefix (its whole blocks shared, a partial
    # last block copied, the conv and recurrent state copied) gives bit for bit the logits the
    # sequence it was cached from gives, and a slot without that state does not.
    seq = ids(length + 40, 12)
    engine.reserve_slots(3, 300)
    feed(engine, seq[:length], slot=0)
    engine.slots.snapshot(0, 7, length)
    want = feed(engine, seq[length:], length, slot=0)
    engine.slots.restore(1, 7)
    torch.testing.assert_close(feed(engine, seq[length:], length, slot=1), want, atol=0, rtol=0)
    engine.slots.blocks.adopt(2, engine.slots.cached[7].blocks)
    assert not torch.equal(feed(engine, seq[length:], length, slot=2), want)


def test_an_entrys_state_copies_live_on_a_mapping_of_their_own_that_its_eviction_gives_back(engine):
    # Not in glibc's heap, where long-lived copies among a pass's short-lived buffers held it
    # apart and it never shrank: one mapping per entry, unmapped when the entry is evicted.
    from test_host_memory import mapped

    engine.reserve_slots(2, 300)
    feed(engine, ids(70, 3), slot=0)
    engine.slots.snapshot(0, 4, 70)
    copies = [t for saved in engine.slots.cached[4].saved if saved for t in saved]
    assert copies and len({t.untyped_storage().data_ptr() for t in copies}) == 1
    base = copies[0].untyped_storage().data_ptr()
    assert mapped(base) and min(t.data_ptr() for t in copies) % host_memory.HUGE_PAGE == 0
    live = [(s.conv, s.recurrent) for s in engine.slots[0] if hasattr(s, "recurrent")]
    assert all(torch.equal(a, b) for pair, saved in zip(live, [s for s in engine.slots.cached[4].saved if s]) for a, b in zip(pair, saved))
    del copies
    engine.slots.evict(4)
    gc.collect()
    assert not mapped(base)


def test_a_prefix_is_cached_in_the_heap_when_no_mapping_can_be_made(engine, monkeypatch):
    # The system's mappings run out (vm.max_map_count): the copies come from the heap, and a slot
    # restored from them runs on as the cached sequence does.
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    seq = ids(110, 9)
    engine.reserve_slots(2, 300)
    feed(engine, seq[:70], slot=0)
    monkeypatch.setattr(mmap, "mmap", refuse)
    engine.slots.snapshot(0, 5, 70)
    monkeypatch.undo()
    want = feed(engine, seq[70:], 70, slot=0)
    engine.slots.restore(1, 5)
    torch.testing.assert_close(feed(engine, seq[70:], 70, slot=1), want, atol=0, rtol=0)


def test_a_request_for_its_prompts_logprobs_runs_its_whole_prompt_past_a_cached_prefix(engine):
    # A cached prefix would skip the positions whose logits score the prompt: such a request takes
    # no hit, and its logprobs are the ones a cold pass gives.
    from pocketllm.engine.sampling import PromptLogprobs

    prompt = ids(150, 3)
    sched = Scheduler(engine, 2, 400, prefix_cache_bytes=entries(engine, 8))
    drain(sched, prompt)
    assert sched.kv_usage().prefix_misses == 1 and engine.slots.cached
    scores = PromptLogprobs(prompt, 1)
    req = sched.submit(prompt, 0, prompt_logits=scores)
    while sched.has_work:
        sched.step()
    assert (req.finish_reason, req.output) == ("length", [])
    assert sorted(scores.scored) == list(range(1, len(prompt)))
    want = torch.log_softmax(feed(engine, prompt, all_logits=True).double(), dim=-1)
    got = [scores.scored[p].logprob for p in range(1, len(prompt))]
    assert got == pytest.approx([float(want[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=1e-4)
    assert sched.kv_usage().prefix_hits == 0


def test_a_request_scoring_its_prompt_caches_none_of_it_and_none_waits_for_it(engine, monkeypatch):
    # It never reads the cache, so it leaves nothing there; a request on the same prompt beside
    # it does not wait for chunk ends it will not cache, and runs as it would alone.
    from pocketllm.engine.sampling import PromptLogprobs

    prompt = ids(200, 8)
    cold = generate(engine, prompt, NEW)
    sched = Scheduler(engine, 2, 400, prefix_cache_bytes=entries(engine, 8))
    engine.slots.cached.clear()
    snapshots = []
    real = engine.slots.snapshot
    monkeypatch.setattr(engine.slots, "snapshot", lambda *a: snapshots.append(a) or real(*a))
    scoring = sched.submit(prompt, 0, prompt_logits=PromptLogprobs(prompt, 0))
    sched.step()
    plain = sched.submit(prompt, NEW)
    sched.step()
    assert plain.slot is not None and scoring.fed < len(prompt), "it waited for the scoring request"
    slot = plain.slot
    while sched.has_work:
        sched.step()
    assert plain.output == cold and scoring.finish_reason == "length"
    # Only the plain request's own chunk ends were cached.
    assert {a[0] for a in snapshots} == {slot}


def test_requests_sharing_a_prompt_read_it_once_and_start_from_its_chunk_ends(engine, monkeypatch):
    # A request's n choices (the same prompt three times) and a harness's prompts sharing a
    # context: the later ones wait for the first to cache its chunk ends, then read only the rest,
    # with the tokens each gets alone.
    context = ids(150, 5)
    prompts = [context + ids(50, 6)] * 3 + [context + ids(20, 7)]
    cold = [generate(engine, p, NEW) for p in prompts]
    sched = Scheduler(engine, 4, 400, prefix_cache_bytes=entries(engine, 8))
    read = []
    real = engine.run_packed

    def counting(spans, all_logits=False):
        read.extend(min(start + ids.shape[0], 150) - start for _, start, ids in spans if start < 150)  # of the first 150 positions
        return real(spans, all_logits=all_logits)

    monkeypatch.setattr(engine, "run_packed", counting)
    reqs = [sched.submit(p, NEW) for p in prompts]
    while sched.has_work:
        sched.step()
    assert [r.output for r in reqs] == cold
    # The first reads the 200-token prompt; the others start from its entry at 192 (the same
    # prompt) or at 128 (the shared context), so of the context's 150 positions only the first
    # prompt's and the last one's 128..149 are read.
    assert sum(read) == 150 + (150 - 128), read
    usage = sched.kv_usage()
    assert (usage.prefix_hits, usage.prefix_misses) == (3, 1)


def test_a_chat_turn_starts_at_the_last_chunk_end_of_the_history(engine):
    turn1 = ids(150, 1)
    reply = generate(engine, turn1, NEW)
    turn2 = turn1 + reply + ids(30, 2)
    cold = generate(engine, turn2, NEW)
    sched = Scheduler(engine, 2, 400, prefix_cache_bytes=entries(engine, 8))
    assert drain(sched, turn1).output == reply
    # Its prompt's chunk ends; not where it stopped (150 + 7 positions, the last 7 decode rows,
    # which a cold run of the next turn computes as a prompt).
    assert sorted(c.length for c in engine.slots.cached.values()) == [64, 128]
    got = drain(sched, turn2)
    usage = sched.kv_usage()
    assert (usage.prefix_hits, usage.prefix_misses, usage.prefix_hit_tokens) == (1, 1, 128)
    assert got.output == cold
    # turn2's own chunk ends are cached as it reads them: its first two are turn1's.
    assert sorted(c.length for c in engine.slots.cached.values()) == [64, 128]


def test_without_invariance_a_chat_turn_starts_where_the_last_one_stopped(variant_engine):
    engine = variant_engine
    turn1 = ids(100, 1)
    reply = generate(engine, turn1, NEW)
    turn2 = turn1 + reply + ids(30, 2)
    cold = generate(engine, turn2, NEW)
    sched = Scheduler(engine, 2, 400, prefix_cache_bytes=entries(engine, 8))
    assert drain(sched, turn1).output == reply
    # It stopped after 100 + 7 positions (its last token was never fed): 107 is 43 rows into its
    # second block, which a hit copies.
    assert [c.length for c in engine.slots.cached.values()] == [107]
    got = drain(sched, turn2)
    usage = sched.kv_usage()
    assert (usage.prefix_hits, usage.prefix_misses, usage.prefix_hit_tokens) == (1, 1, 107)
    assert got.output == cold


def test_a_long_prompt_is_cached_at_its_chunk_ends(engine):
    long = ids(200, 3)
    branch = long[:150] + ids(20, 4)
    cold = [generate(engine, p, NEW) for p in (long, branch, long)]
    sched = Scheduler(engine, 2, 400, prefill_budget=64, prefix_cache_bytes=entries(engine, 8))
    assert drain(sched, long).output == cold[0]
    assert sorted(c.length for c in engine.slots.cached.values()) == [64, 128, 192]
    # The branch shares 150 tokens: the longest cached prefix of them ends at the chunk end
    # 128, two whole blocks and nothing to copy.
    assert drain(sched, branch).output == cold[1] and sched.kv_usage().prefix_hit_tokens == 128
    # The same prompt again: everything to its last chunk end is cached.
    assert drain(sched, long).output == cold[2] and sched.kv_usage().prefix_hit_tokens == 128 + 192


def test_the_cache_forgets_the_least_recently_used_under_its_budget(engine):
    first, second, third = ids(90, 5), ids(90, 6), ids(90, 7)
    sched = Scheduler(engine, 1, 400, prefix_cache_bytes=entries(engine, 2))
    outs = [drain(sched, p).output for p in (first, second)]
    # A hit on the first makes the second the least recently used one.
    drain(sched, first + outs[0] + [1, 2])
    drain(sched, third)
    assert sorted(c.tokens[:3] for c in sched.prefix.entries.values()) == sorted([tuple(first[:3]), tuple(third[:3])])
    usage = sched.kv_usage()
    drain(sched, second + outs[1] + [3])
    assert sched.kv_usage().prefix_misses == usage.prefix_misses + 1


def test_cached_blocks_go_back_before_a_running_request_is_preempted(engine):
    short, long = ids(130, 8), ids(190, 9)
    cold = generate(engine, long, NEW)
    # A pool of one 200-position sequence: the short request's cached prefixes (its chunk ends
    # 64 and 128) hold 2 of its 4 blocks when the long one needs all 4.
    sched = Scheduler(engine, 2, 200, kv_blocks=blocks_for(200), prefix_cache_bytes=entries(engine, 4))
    drain(sched, short)
    assert sched.slots.blocks.num_used == 2 and len(engine.slots.cached) == 2
    usage = sched.kv_usage()
    assert (usage.blocks_used, usage.prefix_blocks) == (0, 2)
    assert drain(sched, long).output == cold
    assert sched.preemptions == 0 and sorted(c.length for c in engine.slots.cached.values()) == [64, 128]
    assert all(c.tokens == tuple(long[: c.length]) for c in sched.prefix.entries.values())


@pytest.mark.timeout(30)
def test_a_chat_in_a_pool_of_one_sequence_takes_over_the_cached_partial_block(variant_engine):
    # Each turn's cached prefix (where the last one stopped) holds most of the pool; the next turn
    # cannot get a block to copy the prefix's partial last block into, so it takes that block over
    # (and the entry with it) instead of waiting for ever.
    engine = variant_engine
    history, prompts, outs = ids(300, 13), [], []
    sched = Scheduler(engine, 1, 480, kv_blocks=blocks_for(480), prefix_cache_bytes=entries(engine, 8))
    for turn in range(3):
        prompts.append(history + ids(50, 14 + turn))
        outs.append(drain(sched, prompts[-1]).output)
        history = prompts[-1] + outs[-1]
    assert sched.kv_usage().prefix_hits == 2
    assert outs == [generate(engine, p, NEW) for p in prompts]


def test_the_other_ranks_replay_every_cache_operation(engine, monkeypatch):
    follower = tiny_engine()
    follower.prefill_chunk = CHUNK
    follower.reserve_slots(3, 300, 9)
    # Two operations a plan: a step's releases, snapshots, restores and evictions span several.
    seen = follow_in_process(monkeypatch, engine, follower, 3, max_ops=2, prefill_budget=64)
    base = ids(120, 10)
    prompts = [base + ids(10 * k + 5, 11 + k) for k in range(5)]
    cold = [generate(engine, p, NEW) for p in prompts]
    sched = Scheduler(engine, 3, 300, kv_blocks=9, prefill_budget=64, prefix_cache_bytes=entries(engine, 3))
    requests = [sched.submit(p, NEW) for p in prompts]
    while sched.has_work:
        sched.step()
    assert [r.output for r in requests] == cold
    assert {SNAPSHOT, RESTORE, EVICT} <= {op[0] for op in seen}


def test_a_lookup_confirms_every_token_and_leaves_one_to_run():
    cache = PrefixCache(4, 4)
    entry = cache.add([1, 2, 3, 4, 5, 6])
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7]) is entry
    assert cache.lookup([1, 2, 3, 4, 5, 6]) is None  # nothing would be left to run
    assert cache.lookup([1, 2, 3, 4, 5, 9, 7]) is None
    shorter = cache.add([1, 2, 3, 4, 5])
    assert cache.lookup([1, 2, 3, 4, 5, 6]) is shorter and cache.find([1, 2, 3, 4, 5]) is shorter


def test_prefix_counts_reach_metrics():
    usage = KVUsage(40, 10, 64, 0, prefix_caching=True, prefix_hits=3, prefix_misses=5, prefix_hit_tokens=700, prefix_entries=2, prefix_blocks=6)
    m = parse(Metrics().render(0, 0, usage))
    assert m["pocketllm_prefix_cache_blocks"] == 6 and m["pocketllm_kv_cache_blocks_used"] == 10
    assert (m["pocketllm_prefix_cache_hits_total"], m["pocketllm_prefix_cache_misses_total"]) == (3, 5)
    assert (m["pocketllm_prefix_cache_hit_tokens_total"], m["pocketllm_prefix_cache_entries"]) == (700, 2)
    assert "pocketllm_prefix_cache_hits_total" not in parse(Metrics().render(0, 0, KVUsage(40, 10, 64, 0)))


def test_a_devices_plans_are_host_memory():
    """The plans rank 0 sends go over the group's CPU backend on every device (gloo beside NCCL or
    HCCL): in device memory each pass cost copies both ways, and a rank waiting for the next plan
    on NCCL returned from wait() at once with a kernel spinning on its device."""
    from types import SimpleNamespace

    from pocketllm.engine.pass_plan import pass_plan_for

    plan = pass_plan_for(SimpleNamespace(device=torch.device("meta"), prefill_chunk=CHUNK), 3, 64)
    assert plan.buf.device.type == "cpu"
    plan.encode([(SNAPSHOT, 1, 2, 3)], [(0, 5, [7, 8])])
    ops, spans, _ = plan.decode()
    assert ops == [(SNAPSHOT, 1, 2, 3)] and [(s, p, t.tolist()) for s, p, t in spans] == [(0, 5, [7, 8])]

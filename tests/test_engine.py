"""Engine-level consistency on the tiny preset in fp32, in process at TP=1: prefill then decode
equals one longer prefill, and the state caches behave across sequences."""

from __future__ import annotations

import pytest
import torch

from conftest import feed, tiny_engine

from pocketllm.distributed.policy import RulePolicy
from pocketllm.distributed.state import set_tp
from pocketllm.engine.generate import generate
from pocketllm.engine.runner import Engine
from pocketllm.loader import random_weights
from pocketllm.loader.random_weights import RandomWeights, random_tensor
from pocketllm.presets import get_preset

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def engine():
    set_tp(0, 1)
    cfg = get_preset("tiny").with_layers(8)
    return Engine(cfg, RandomWeights(cfg), torch.float32, torch.device("cpu"), RulePolicy())


class _Passes:
    def __init__(self):
        self.seen = []
        self.collectives = []

    def before_pass(self, info) -> None:
        pass

    def after_pass(self, info) -> None:
        self.seen.append((info.kind, info.rows, info.slices))
        self.collectives.append(info.collectives)


def ids(n: int, offset: int = 0) -> torch.Tensor:
    return torch.tensor([(13 * i + 5 + offset) % 1000 for i in range(n)])


@pytest.mark.parametrize("prompt_len,decode_steps", [(1, 5), (70, 6), (130, 3)], ids=lambda v: str(v))
def test_prefill_then_decode_equals_longer_prefill(engine, prompt_len, decode_steps):
    seq = ids(prompt_len + decode_steps)
    engine.reserve_slots(1, len(seq))
    full = feed(engine, seq, all_logits=True)
    step_logits = [feed(engine, seq[:prompt_len])]
    for pos, t in enumerate(seq[prompt_len:].tolist(), start=prompt_len):
        step_logits.append(feed(engine, [t], pos))
    torch.testing.assert_close(torch.stack(step_logits), full[prompt_len - 1 :], atol=1e-4, rtol=1e-4)


def test_prefill_in_two_parts_equals_one(engine):
    """A second prefill continues from the first's conv, recurrent and KV state."""
    seq = ids(150, offset=7)
    engine.reserve_slots(1, 150)
    whole = feed(engine, seq)
    feed(engine, seq[:90])
    torch.testing.assert_close(feed(engine, seq[90:], 90), whole, atol=1e-4, rtol=1e-4)


def test_new_sequence_forgets_the_previous_one(engine):
    # A span from position 0 clears its slot's conv and recurrent state (the KV rows it reads
    # are its own): the same prompt after another gives the same logits, bit for bit.
    engine.reserve_slots(1, 40)
    first = feed(engine, ids(40, offset=3))
    feed(engine, ids(40, offset=11))
    torch.testing.assert_close(feed(engine, ids(40, offset=3)), first, atol=0, rtol=0)


def test_prompt_logits_come_from_the_one_prefill(engine, monkeypatch):
    # --logits-out used to run the prompt a second time; now the generation's own prefill hands
    # its every-row logits over, and the tokens are those of a plain generation.
    prompt = ids(20, offset=5).tolist()
    plain = generate(engine, prompt, 4)
    prefills, seen = [], []
    real_run = engine.run_packed

    def run(spans, **kw):
        prefills.extend(len(ids) for _, _, ids in spans if len(ids) > 1)
        return real_run(spans, **kw)

    monkeypatch.setattr(engine, "run_packed", run)
    tokens = generate(engine, prompt, 4, prompt_logits=seen.append)
    assert prefills == [20] and tokens == plain
    assert seen[0].shape == (20, engine.cfg.vocab_size)
    torch.testing.assert_close(seen[0], real_run([(0, 0, torch.tensor(prompt))], all_logits=True), atol=0, rtol=0)


def test_every_row_logits_end_with_the_one_row_heads_logits():
    # In bf16 at hidden 1024 a [T, V] head GEMM rounds the last row differently from the one-row
    # GEMV (by up to 4e-3 at 64 rows); an all_logits pass recomputes that row the one-row way, so
    # `generate --logits-out` picks the tokens a run without it does.
    set_tp(0, 1)
    cfg = get_preset("small").with_layers(2)
    bf16 = Engine(cfg, RandomWeights(cfg, dtype=torch.bfloat16), torch.bfloat16, torch.device("cpu"), RulePolicy())
    prompt = ids(64).tolist()
    bf16.reserve_slots(1, 64)
    last = feed(bf16, prompt)
    every = feed(bf16, prompt, all_logits=True)
    torch.testing.assert_close(every[-1], last, atol=0, rtol=0)
    assert every.shape == (64, cfg.vocab_size)


def test_a_prompt_longer_than_a_pass_runs_in_passes_with_the_tokens_and_logits_of_one(engine, monkeypatch):
    """generate carries at most LONGEST_PASS_ROWS prompt rows a pass (its activations bounded): a
    longer prompt runs in passes of that many, cut where the CPU's chunks end, with one pass's
    tokens and prompt logits."""
    from pocketllm.engine import budgets

    prompt = ids(600).tolist()
    kept = []
    whole = generate(engine, prompt, 4, prompt_logits=kept.append)
    passes = []
    real = engine.run_packed
    monkeypatch.setattr(engine, "run_packed", lambda spans, **kw: passes.append(sum(len(t) for _, _, t in spans)) or real(spans, **kw))
    monkeypatch.setattr(budgets, "LONGEST_PASS_ROWS", 256)
    assert generate(engine, prompt, 4, prompt_logits=kept.append) == whole
    assert passes[:3] == [256, 256, 88]
    # Each pass's last row is the one-row head's (as a prompt's last row always is): there alone
    # the logits may differ, by the two heads' rounding.
    differ = (kept[1] != kept[0]).any(dim=-1).nonzero().flatten().tolist()
    assert set(differ) <= {255, 511}, differ
    torch.testing.assert_close(kept[1], kept[0], rtol=1e-5, atol=1e-5)


def test_each_token_is_handed_over_before_the_step_it_feeds(engine, monkeypatch):
    # What `generate --stream` prints by: token k arrives after k decode steps, not at the end.
    decodes, seen = [], []
    real_run = engine.run_packed
    monkeypatch.setattr(engine, "run_packed", lambda spans, **kw: decodes.extend(s for _, s, ids in spans if s > 0) or real_run(spans, **kw))
    tokens = generate(engine, ids(12, offset=2).tolist(), 5, on_token=lambda t: seen.append((t, len(decodes))))
    assert seen == [(t, k) for k, t in enumerate(tokens)] and len(tokens) == 5


def test_a_generation_builds_its_rotary_rows_before_its_first_pass(engine, monkeypatch):
    # Bench times decode steps: none of them may be the one that (re)builds the rotary table. From
    # an empty table, a generation builds it once, for all its positions, before its prefill.
    from pocketllm.layers import rotary

    builds, real_table = [], rotary.rotary_table
    monkeypatch.setattr(rotary, "rotary_table", lambda inv_freq, n: builds.append(n) or real_table(inv_freq, n))
    rope = engine.model.rotary
    rope._set(rope._cos[:0], rope._sin[:0])
    passes = _Passes()
    passes.before_pass = lambda info: passes.seen.append(len(builds))
    engine.hooks.append(passes)
    try:
        tokens = generate(engine, ids(9, offset=4).tolist(), 7)
    finally:
        engine.hooks.remove(passes)
    assert len(tokens) == 7 and builds == [16]
    assert [s for s in passes.seen if isinstance(s, int)] == [1] * 7
    # The table it built is the positions' own cos and sin.
    torch.testing.assert_close(rope.cos_sin(15, 1)[0], real_table(rope.inv_freq, 16)[0][15:], atol=0, rtol=0)


def test_each_pass_is_reported_with_its_kind_rows_and_no_collectives_at_world_one(engine):
    # What profiles and bench count by (engine.last_pass, hooks): a prompt's prefill, its decode
    # steps, and a pass packing a prompt with a decode row (a prefill); one rank issues no
    # all-reduce in any of them.
    passes = _Passes()
    engine.reserve_slots(2, 16)
    engine.hooks.append(passes)
    try:
        first = engine.last_pass.index if engine.last_pass else -1
        feed(engine, ids(8))
        feed(engine, [5], 8)
        engine.run_packed([(0, 9, torch.tensor([6])), (1, 0, ids(5, offset=1))])
        engine.run_packed([(0, 10, torch.tensor([7])), (1, 5, torch.tensor([8]))])
    finally:
        engine.hooks.remove(passes)
    assert [(kind, rows) for kind, rows, _ in passes.seen] == [("prefill", 8), ("decode", 1), ("prefill", 6), ("decode", 2)]
    assert engine.last_pass.index == first + 4 and engine.last_pass.rows == 2
    assert passes.collectives == [{}] * 4


def test_random_slice_reads_match_the_full_tensor(monkeypatch):
    # A slice generates its tensor once and casts only the rows read: the same values as casting
    # the whole tensor, for every key and for the ranges a fused projection reads.
    calls = []

    def counting(name, shape, seed, device=None):
        calls.append(name)
        return random_tensor(name, shape, seed, device)

    # The slice looks the generator up in its module at read time; the reference values below come
    # from the unpatched function, imported before the patch, and are not counted.
    monkeypatch.setattr(random_weights, "random_tensor", counting)
    rw = RandomWeights(get_preset("tiny"), dtype=torch.bfloat16)
    for key, shape in rw.shapes.items():
        sl = rw.get_slice(key)
        full = random_tensor(key, shape, 0).to(torch.bfloat16)
        calls.clear()
        for idx in (slice(None), slice(0, shape[0] // 2), slice(shape[0] // 3, None)):
            assert torch.equal(sl[idx], full[idx]), key
        assert calls == [key], f"{key}: generated {len(calls)} times over three reads of one slice"


@pytest.mark.parametrize("cap", [None, 24], ids=["timed-length", "capped"])
def test_warm_up_runs_each_timed_length_under_the_timed_slice_policy(engine, cap):
    from pocketllm.engine.timing import warm_up
    from pocketllm.distributed.policy import PinnedPolicy

    saved, passes = engine.policy, _Passes()
    engine.policy = PinnedPolicy(3)
    engine.hooks.append(passes)
    try:
        warm_up(engine, ids(40).tolist(), [32, 16, 32], lambda: None, cap)
    finally:
        engine.policy = saved
        engine.hooks.remove(passes)
    lengths = [16, 24] if cap else [16, 32]
    # The decode rows, fewer than the pin, run serial: slice count 1.
    assert passes.seen == [p for n in lengths for p in [("warmup", n, 3), ("warmup", 1, 1), ("warmup", 1, 1)]]


def test_a_timed_run_reports_the_slices_its_projections_ran_with(engine):
    """One rank has nothing to all-reduce, so a pin of 3 over 16 rows runs serial: the bench's
    figure says 1, not the 3 the pin chose."""
    from pocketllm.distributed.policy import PinnedPolicy
    from pocketllm.engine.timing import timed_prefill_decode

    saved, passes = engine.policy, _Passes()
    engine.policy = PinnedPolicy(3)
    engine.hooks.append(passes)
    try:
        r = timed_prefill_decode(engine, ids(16).tolist(), 1, lambda: None)
    finally:
        engine.policy = saved
        engine.hooks.remove(passes)
    assert passes.seen[0] == ("prefill", 16, 3) and r["slices"] == 1


def test_warming_up_the_shapes_runs_their_passes_and_leaves_the_slot_free():
    # What serve runs on a device before its first request: two prompts (16 and 17 rows) and a
    # decode row, untimed, in slot 0, which then holds nothing.
    engine = tiny_engine(torch.float32)
    engine.reserve_slots(2, 64)
    seen = []

    class Watch:
        watches_layers = False

        def before_pass(self, info):
            seen.append((info.kind, info.rows))

        def after_pass(self, info):
            pass

    engine.hooks.append(Watch())
    engine.warm_up_shapes()
    assert seen == [("warmup", 16), ("warmup", 17), ("warmup", 1)]
    assert engine.slots.free_blocks == engine.slots.blocks.num_blocks
    # A slot too short for them gets what fits: a prompt and a decode row within its positions.
    seen.clear()
    engine.reserve_slots(2, 9)
    engine.warm_up_shapes()
    assert seen == [("warmup", 8), ("warmup", 1)] and engine.slots.free_blocks == engine.slots.blocks.num_blocks
    engine.reserve_slots(2, 64)
    # The slot runs a new sequence as any fresh one does.
    fresh = tiny_engine(torch.float32)
    fresh.reserve_slots(2, 64)
    assert torch.equal(feed(engine, [1, 2, 3]), feed(fresh, [1, 2, 3]))

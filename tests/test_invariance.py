"""Batch invariance (bf16, the default, and int4 weights; in process at TP=1): what a sequence's
rows get does not depend on what else a pass holds. A decode row's logits are bit for bit the same alone, beside
other decode rows and beside other prompts' chunks; a prompt chunk's the same alone and packed
with others; and through the scheduler a request's every logits row is the same alone, among
others with prompts read over several passes, after a preemption (its prompt read again, its
tokens replayed as decode rows) and from a cached prefix. The model is the tiny preset made wide
enough that the compiled and torch forms of a norm round apart. tests/test_serve.py checks the
text through the server at TP=1 and TP=2."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_engine

from pocketllm.engine.generate import generate
from pocketllm.engine.sampling import SamplingParams
from pocketllm.engine.scheduler import Scheduler
from pocketllm.ops.gemv import panels
from pocketllm.ops.registry import layout
from pocketllm.ops.registry.kinds import FEW, ONE, kind_for, weight_format
from pocketllm.presets import get_preset
from pocketllm.quantization import WeightPlan, parse_scheme

torch.set_num_threads(2)

WIDE = dataclasses.replace(get_preset("tiny"), hidden_size=256, intermediate_size=512)
CHUNK = 32
NEW = 8
# A one-token prompt, one inside a chunk, several crossing chunk ends; 60 grows past a KV block
# while it decodes.
LENGTHS = (1, 60, 5, 70, 100, 33)
# Greedy and seeded requests side by side.
PARAMS = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=5)] * 3


@pytest.fixture(scope="module", params=["rows", "panels", "int4-g32"])
def engine(request):
    """The measured kernels (tests/test_gemv.py checks the one-row kernel run row by row, where no
    few-row kernel sums like it), the bf16 weights held as loaded and in panels
    (tests/test_panels.py; where the CPU has no AVX2, panels are not offered), and quantized at
    load to int4 in groups of 32 (whose measured kernels may round x to int8, as llama.cpp's do)."""
    if request.param == "panels" and panels.unavailable():
        pytest.skip(f"panels: {panels.unavailable()}")
    if request.param.startswith("int"):
        engine = tiny_engine(torch.bfloat16, cfg=dataclasses.replace(WIDE, weights=WeightPlan(parse_scheme(request.param))))
        assert weight_format(engine.model.layers[0].mlp.down.weight) == request.param
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(layout.ENV, request.param)
            engine = tiny_engine(torch.bfloat16, cfg=WIDE)
        assert engine.layout.layout == request.param
    engine.prefill_chunk = CHUNK
    return engine


def prompt(n: int, seed: int) -> list[int]:
    return [(37 * i + 11 * seed + 5) % 1000 for i in range(n)]


PROMPTS = [prompt(n, i) for i, n in enumerate(LENGTHS)]


def test_a_decode_row_and_a_prompt_chunk_get_the_same_logits_in_any_pass(engine):
    engine.reserve_slots(6, 200)
    down = engine.model.layers[0].mlp.down
    names, fmt = down.kernels.names, weight_format(down.weight)
    few, one = kind_for(fmt, FEW), kind_for(fmt, ONE)
    if engine.kernels.choices and one.by_name[names["one-row"]].row_order:
        # The measured set, where the one-row kernel measured fastest is one with a declared
        # order of sums (a compiled one, not torch's): decode steps of several rows run a
        # few-row kernel of its own that sums each row in that order (whichever the machine
        # measured fastest), not the one-row kernel row by row.
        assert names["4-row"] in few.by_name, names
        assert few.by_name[names["4-row"]].row_order == one.by_name[names["one-row"]].row_order, names

    def prefill(slots):
        for s in slots:
            engine.run_packed([(s, 0, torch.tensor(PROMPTS[s]))])

    def decode(s):
        return (s, len(PROMPTS[s]), torch.tensor([s + 1]))

    prefill(range(6))
    alone = [engine.run_packed([decode(s)])[0] for s in range(6)]
    chunk_alone = engine.run_packed([(5, 0, torch.tensor(PROMPTS[5]))])[0]
    long_alone = engine.run_packed([(4, 0, torch.tensor(PROMPTS[4]))])[0]
    prefill(range(6))
    # Five decode rows together, in a shuffled order.
    order = [3, 0, 4, 1, 2]
    step = engine.run_packed([decode(s) for s in order])
    for i, s in enumerate(order):
        assert torch.equal(step[i], alone[s]), f"decode row of {s} among {len(order)}"
    # Decode rows beside a prompt chunk, and between two.
    prefill(range(6))
    mixed = engine.run_packed([(5, 0, torch.tensor(PROMPTS[5])), decode(1), decode(3)])
    assert torch.equal(mixed[0], chunk_alone) and torch.equal(mixed[1], alone[1]) and torch.equal(mixed[2], alone[3])
    prefill([0, 2, 3])
    cut = 2 * CHUNK
    mixed = engine.run_packed([decode(0), (4, 0, torch.tensor(PROMPTS[4][:cut])), decode(2), (4, cut, torch.tensor(PROMPTS[4][cut:])), decode(3)])
    assert torch.equal(mixed[0], alone[0]) and torch.equal(mixed[2], alone[2]) and torch.equal(mixed[4], alone[3])
    # The prompt read in two spans of one pass, cut at one of its chunk ends (where the scheduler
    # cuts a prompt), is the prompt read at once. A cut elsewhere ends a segment there, and the
    # segments' sums are grouped otherwise (the chunked gated delta rule, a GEMM's row count).
    assert torch.equal(mixed[3], long_alone)


class Recorder:
    """Every logits row the engine returns, by the tokens it follows (the request's own up to
    that row), while a scheduler runs."""

    def __init__(self, engine):
        self.engine, self.rows, self.sched = engine, {}, None
        self._run = engine.run_packed

    def __enter__(self):
        # A lone greedy decode row returns its token alone: here it returns its logits too.
        self.engine.run_packed = self.run_packed
        self.engine.greedy_row = lambda slot, pos, token: int(torch.argmax(self.run_packed([(slot, pos, torch.tensor([token]))])[0]))
        return self

    def __exit__(self, *exc):
        del self.engine.run_packed
        del self.engine.greedy_row

    def run_packed(self, spans, all_logits=False):
        out = self._run(spans, all_logits)
        for i, (slot, start, ids) in enumerate(spans):
            req = next(r for r in self.sched.running if r.slot == slot)
            self.rows.setdefault(tuple(req.tokens(start + len(ids))), []).append(out[i].clone())
        return out

    def run(self, prompts, params, **kw):
        self.sched = Scheduler(self.engine, max_len=150, **kw)
        requests = [self.sched.submit(p, NEW, sp) for p, sp in zip(prompts, params)]
        while self.sched.has_work:
            self.sched.step()
        return [r.output for r in requests]


def test_a_requests_every_logits_row_is_the_same_alone_batched_preempted_and_cached(engine):
    params = PARAMS
    with Recorder(engine) as alone:
        tokens = [alone.run([p], [sp], max_running=1) for p, sp in zip(PROMPTS, params)]
    assert tokens[-1][0] == generate(engine, PROMPTS[-1], NEW, params[-1])

    def same(rec: Recorder, outputs) -> int:
        assert outputs == [t[0] for t in tokens]
        compared = 0
        for key, rows in rec.rows.items():
            for row in rows:
                assert torch.equal(row, alone.rows[key][0]), f"position {len(key)} of a request starting {key[:3]}"
                compared += 1
        return compared

    with Recorder(engine) as rec:
        # Prompts read a chunk a pass, two chunks' worth a pass in all, beside decode steps.
        assert same(rec, rec.run(PROMPTS, params, max_running=6, prefill_budget=2 * CHUNK)) >= len(PROMPTS) * NEW
    with Recorder(engine) as rec:
        # A pool of three blocks: the last admitted is preempted when the 60-token prompt grows
        # into its second block; it reads its prompt again and
        # replays its tokens as the decode rows they were.
        outputs = rec.run(PROMPTS, params, max_running=6, kv_blocks=3)
        assert rec.sched.preemptions > 0
        same(rec, outputs)
    with Recorder(engine) as rec:
        # The long prompts twice: the second run starts from their chunk ends.
        again = [i for i, n in enumerate(LENGTHS) if n > CHUNK]
        outputs = rec.run(PROMPTS + [PROMPTS[i] for i in again], params + [params[i] for i in again], max_running=3, prefix_cache_bytes=64 * engine.slots.sequence_bytes())
        assert rec.sched.prefix.hits >= 2 and outputs[len(PROMPTS) :] == [outputs[i] for i in again]
        same(rec, outputs[: len(PROMPTS)])

"""The decode step of one sequence as one compiled call (pocketllm.models.compiled_step) against the
layers' path it stands for: the same bits, step after step, for bf16 and quantized weights, with
attention split over the threads; and every case it must leave to the layers."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from conftest import feed, tiny_engine

from pocketllm.ops.fused import kernels as fused_kernels
from pocketllm.ops.gemv import panels
from pocketllm.presets import get_preset
from pocketllm.profiling import scopes
from pocketllm.quantization import WeightPlan, parse_scheme

# A one-row kernel of compiled code for each weight format, forced so that no measurement can
# choose a torch op for the tiny shapes.
COMPILED = {"POCKETLLM_KERNELS": "one-row=c-prefetch,int8-one-row=c-ahead,int4-one-row=c-int8x"}


def _engine(monkeypatch, scheme: str | None):
    for name, value in COMPILED.items():
        monkeypatch.setenv(name, value)
    if scheme == "panels":  # bf16 weights in panels (ops/gemv/panel_bf16.c)
        if panels.unavailable():
            pytest.skip(f"panels: {panels.unavailable()}")
        monkeypatch.setenv("POCKETLLM_BF16_LAYOUT", "panels")
        monkeypatch.setenv("POCKETLLM_KERNELS", "panels-one-row=c")
        engine = tiny_engine(torch.bfloat16)
        assert engine.held == "panels" and engine.model.layers[0].mlp.down.kernels.names["one-row"] == "c"
        return engine
    if scheme == "int8-int8x":  # int8 weights against int8 x (ops/quant/gemv_int8_int8x.c)
        monkeypatch.setenv("POCKETLLM_KERNELS", COMPILED["POCKETLLM_KERNELS"].replace("int8-one-row=c-ahead", "int8-one-row=c-int8x"))
        scheme = "int8"
    cfg = get_preset("tiny")
    if scheme:
        cfg = dataclasses.replace(cfg, weights=WeightPlan(parse_scheme(scheme)))
    return tiny_engine(torch.bfloat16, cfg=cfg)


def _decode(engine, prompt: list[int], steps: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's logits after the prompt, and the GDN states they leave."""
    feed(engine, prompt)
    logits = [feed(engine, [t], start=len(prompt) + i).clone() for i, t in enumerate(steps)]
    return logits, [s.recurrent.clone() for s in engine.slots[0] if hasattr(s, "recurrent")]


@pytest.mark.parametrize("scheme", [None, "panels", "int8", "int8-int8x", "int4-g32"])
def test_a_step_as_one_call_gives_the_layers_bits(monkeypatch, scheme):
    # Attention splits the cache over both threads from a few positions on (as it does past
    # thousands at the real sizes), and the steps cross KV blocks. The step is described under one
    # thread and runs under two, as its attention must see.
    monkeypatch.setattr(fused_kernels, "ATTENTION_PARALLEL_MIN", 1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = _engine(monkeypatch, scheme)
        torch.set_num_threads(2)
        assert engine.step is not None and engine.describe_step() == "decode step: one compiled call"
        engine.reserve_slots(1, 200)
        prompt = [(7 * i + 3) % 1000 for i in range(100)]
        steps = [(11 * i + 1) % 1000 for i in range(40)]
        calls = []
        step = engine.step
        run = step._run
        monkeypatch.setattr(step, "_run", lambda *a: calls.append(1) or run(*a))
        fast, fast_states = _decode(engine, prompt, steps)
        # Every step ran as one call, its attention split over the threads the layers' would use
        # (the logits' bf16 rounding hides a different split's fp32 order).
        assert len(calls) == len(steps) and step.step.threads == 2
        engine.step = None
        plain, plain_states = _decode(engine, prompt, steps)
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(fast, plain)):
        assert torch.equal(a, b), f"step {i}"
    for a, b in zip(fast_states, plain_states):
        assert torch.equal(a, b)


def _rows_then_layers(engine, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's logits for the decode rows of every prompt's sequence in one pass, first as the
    engine runs them, then again from the same prompts with the step backend off (the layers)."""
    out = []
    for backend in (engine.step, None):
        engine.step = backend
        for slot, prompt in enumerate(prompts):
            feed(engine, prompt, slot=slot)
        tokens, logits = [(5 + 97 * s) % 1000 for s in range(len(prompts))], []
        for i in range(steps):
            logits.append(engine.run_packed([(s, len(p) + i, torch.tensor([tokens[s]])) for s, p in enumerate(prompts)]).clone())
            tokens = [int(t) for t in torch.argmax(logits[-1], dim=-1)]
        out.append(logits)
    return out[0], out[1]


@pytest.mark.parametrize("scheme", [None, "panels", "int4-g32"])
def test_decode_rows_of_several_sequences_are_one_call_with_the_layers_bits(monkeypatch, scheme):
    # A pass of eighteen sequences' decode rows, each at its own position, runs as one call
    # (CompiledStep.rows), sixteen rows at a time through each projection's few-row kernel (the
    # largest count chosen for) and then two: each step's logits are the layers' pass's bit for bit.
    # The rows past their first KV block split their attention over the threads (each alone, as in
    # a step of its own); the rest run a row per thread.
    monkeypatch.setattr(fused_kernels, "ATTENTION_PARALLEL_MIN", 20 * 2 * 16)
    engine = _engine(monkeypatch, scheme)
    monkeypatch.setenv("POCKETLLM_KERNELS", os.environ["POCKETLLM_KERNELS"] + ",few-row=c-prefetch" * (scheme is None))
    engine.reserve_slots(18, 100)
    step = engine.step
    assert step.step.rows_max == 16
    calls = []
    rows = step.rows
    monkeypatch.setattr(step, "rows", lambda *a: calls.append(len(a[0])) or rows(*a))
    prompts = [[(7 * i + s) % 1000 for i in range(3 + 5 * s)] for s in range(18)]
    fast, plain = _rows_then_layers(engine, prompts, 3)
    assert calls == [18] * 3 and engine.step is None
    for i, (a, b) in enumerate(zip(fast, plain)):
        assert a.shape == (18, 1000) and torch.equal(a, b), f"step {i}"


def test_two_rows_of_one_sequence_in_a_pass_run_one_after_the_other(monkeypatch):
    # A pass may hold a sequence's next two rows as two spans (run_packed runs spans of one slot in
    # their order): the second needs the first's state, so such a pass is not the rows call, and
    # its logits are those of the two rows fed one at a time.
    engine = _engine(monkeypatch, None)
    monkeypatch.setenv("POCKETLLM_KERNELS", os.environ["POCKETLLM_KERNELS"] + ",few-row=c-prefetch")
    engine.reserve_slots(2, 40)
    assert hasattr(engine.step, "rows")
    monkeypatch.setattr(engine.step, "rows", lambda *a: pytest.fail("the rows call ran two rows of one sequence"))
    prompt = [3, 1, 4, 1, 5]
    feed(engine, prompt)
    both = engine.run_packed([(0, 5, torch.tensor([9])), (0, 6, torch.tensor([2]))])
    feed(engine, prompt)
    one = [feed(engine, [9], start=5).clone(), feed(engine, [2], start=6).clone()]
    assert torch.equal(both, torch.stack(one))


def test_a_set_that_is_not_batch_invariant_runs_several_rows_layer_by_layer(monkeypatch):
    # Not batch-invariant, a few-row kernel may sum a row in another order than one row alone:
    # several rows then take the layers' path, one row still the step.
    for name, value in COMPILED.items():
        monkeypatch.setenv(name, value)
    engine = tiny_engine(torch.bfloat16, invariant=False)
    engine.reserve_slots(2, 40)
    assert engine.describe_step() == "decode step: one compiled call" and not hasattr(engine.step, "rows")


def test_what_runs_layer_by_layer(monkeypatch):
    engine = _engine(monkeypatch, None)
    step = engine.step
    engine.reserve_slots(2, 40)
    for slot in (0, 1):
        feed(engine, [1, 2, 3], slot=slot)

    class Refuse:
        def logits(self, *args):
            raise AssertionError("the compiled step ran")

        greedy = logits

    engine.step = Refuse()
    # Two sequences in one pass, a prompt's rows, every row's logits, and a profiled step: the layers.
    engine.run_packed([(0, 3, torch.tensor([4])), (1, 3, torch.tensor([5]))])
    feed(engine, [6, 7], start=4)
    feed(engine, [8], start=6, all_logits=True)
    scopes.install(scopes.ScopeRecorder())
    try:
        feed(engine, [9], start=7)
    finally:
        scopes.install(None)
    engine.step = step
    feed(engine, [10], start=8)
    with pytest.raises(IndexError, match="token id 1000 is outside the embedding's 1000 rows"):
        feed(engine, [1000], start=9)


def test_a_row_straight_to_the_step_gives_the_passs_logits_and_tokens(monkeypatch):
    # One sequence's decode row goes to the compiled step without the pass around it (run_packed's
    # own shortcut, and greedy_row): the logits are the pass's bit for bit, the greedy tokens its
    # argmax, and each row is counted as a decode pass.
    engine = _engine(monkeypatch, None)
    engine.reserve_slots(2, 120)
    prompt = [(5 * i + 2) % 1000 for i in range(60)]
    step = engine.step
    direct_calls = []
    for name in ("logits", "greedy"):
        original = getattr(step, name)
        monkeypatch.setattr(step, name, lambda *a, _f=original, _n=name: direct_calls.append(_n) or _f(*a))
    for slot in (0, 1):
        feed(engine, prompt, slot=slot)
    token, direct, plain = 17, [], []
    for i in range(20):
        passes = engine._passes
        direct.append(feed(engine, [token], start=len(prompt) + i, slot=0).clone())
        assert engine.last_pass.kind == "decode" and engine.last_pass.rows == 1 and engine._passes == passes + 1
        with monkeypatch.context() as m:
            m.setattr(engine, "_direct_step", lambda *a: None)  # the whole pass, layer by layer
            plain.append(feed(engine, [token], start=len(prompt) + i, slot=1).clone())
        token = int(torch.argmax(plain[-1]))
    for i, (a, b) in enumerate(zip(direct, plain)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {i}"
    # Greedy from the same prompt again in slot 0, against the tokens slot 1 chose.
    feed(engine, prompt, slot=0)
    token, tokens = 17, []
    for i in range(20):
        tokens.append(engine.greedy_row(0, len(prompt) + i, token))
        token = tokens[-1]
    assert tokens == [int(torch.argmax(x)) for x in plain]
    assert direct_calls == ["logits"] * 20 + ["greedy"] * 20


class Recorder:
    """A pass hook that notes each pass's kind and whether the step ran it. `watches_layers`
    False: it only records where the run is (as the pass tracker and fault hook do); a hook
    without the attribute watches the layers."""

    def __init__(self, watches_layers: bool | None):
        if watches_layers is not None:
            self.watches_layers = watches_layers
        self.seen = []

    def before_pass(self, info):
        self.seen.append((info.kind, info.direct))

    def after_pass(self, info):
        self.seen.append("after")


@pytest.mark.parametrize("watches", [None, False], ids=["watching-the-layers", "recording-only"])
def test_a_watching_hook_keeps_the_pass_and_a_recording_one_the_step(monkeypatch, watches):
    # The pass tracker and the fault hook run under every model command: a decode row still goes
    # straight to the step under them, and they still see each pass, labelled as a pass is.
    from pocketllm.fault_injection import FaultHook
    from pocketllm.rank_failures import PassTracker

    engine = _engine(monkeypatch, None)
    engine.reserve_slots(1, 40)
    feed(engine, [1, 2, 3])
    hook = Recorder(watches)
    engine.hooks += [PassTracker(), FaultHook(None, 0), hook]
    before = engine.direct_steps
    token = engine.greedy_row(0, 3, 4)
    feed(engine, [token], start=4)
    direct = watches is False
    assert engine.direct_steps == before + (2 if direct else 0)
    assert hook.seen == [("decode", direct), "after"] * 2
    assert engine.last_pass.kind == "decode" and engine.last_pass.direct == direct


def test_bad_rows_fail_alike_on_the_step_and_through_a_pass(monkeypatch):
    engine = _engine(monkeypatch, None)
    engine.reserve_slots(1, 40)
    feed(engine, [1, 2, 3, 4, 5])
    for row in (lambda: engine.greedy_row(0, 5, 1000), lambda: feed(engine, [1000], start=5)):
        with pytest.raises(IndexError, match="token id 1000 is outside the embedding's 1000 rows"):
            row()
    with pytest.raises(RuntimeError, match="exceeds the 40 reserved per slot"):
        engine.greedy_row(0, 40, 1)


def test_the_steps_argmax_is_torchs():
    from pocketllm.ops.fused import step as native

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(1000, generator=g), torch.zeros(7), torch.tensor([1.0, 3.0, 3.0, 2.0]), torch.full((5,), -float("inf")),
             torch.tensor([1.0, float("nan"), 5.0, float("nan")]), torch.tensor([float("-inf"), 2.0, float("inf"), float("inf")]),
             torch.randn(32001, generator=g).round()]
    # Past eight values the vector passes run: NaN in the vectors or in the tail, the largest in
    # the tail, ties across vectors, signed zeros, all -inf.
    x = torch.randn(1003, generator=g)
    for at in (5, 517, 1001):
        cases += [x.clone().index_fill_(0, torch.tensor([at]), float("nan")), x.clone().index_fill_(0, torch.tensor([at]), 9.0)]
    cases += [torch.tensor([0.0] * 9 + [-0.0] * 9), torch.tensor([-0.0] * 9 + [0.0] * 9), torch.full((19,), -float("inf")),
              torch.tensor([1.0] * 8 + [4.0] + [1.0] * 8 + [4.0] * 3)]
    for x in cases:
        assert native.argmax(x) == int(torch.argmax(x)), x
    # A step's rows in one call, as the scheduler takes its greedy tokens.
    rows = torch.stack([c for c in cases if c.numel() == 1003])
    assert native.argmax_rows(rows) == torch.argmax(rows, dim=-1).tolist()
    assert native.argmax_rows(rows.bfloat16()) is None and native.argmax_rows(rows.t()) is None
    with pytest.raises(ValueError, match="fp32 contiguous CPU logits"):
        native.argmax(torch.zeros(4, dtype=torch.bfloat16))


def test_why_a_model_takes_the_layers_path(monkeypatch):
    monkeypatch.setenv("POCKETLLM_COMPILED_STEP", "0")
    assert _engine(monkeypatch, None).describe_step() == "decode step: layer by layer (POCKETLLM_COMPILED_STEP=0)"
    monkeypatch.delenv("POCKETLLM_COMPILED_STEP")
    monkeypatch.setenv("POCKETLLM_FUSED_DECODE", "0")
    assert _engine(monkeypatch, None).step_choice.note == "the decode ops are not compiled (POCKETLLM_FUSED_DECODE=0)"
    monkeypatch.delenv("POCKETLLM_FUSED_DECODE")
    for name, value in COMPILED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POCKETLLM_KERNELS", "one-row=mv")
    assert tiny_engine(torch.bfloat16).step_choice.note == "a projection's one-row kernel is a torch op"
    assert tiny_engine(torch.float32).step_choice.note.startswith("the decode ops are not compiled")

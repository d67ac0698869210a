"""The decode step over fixed buffers (pocketllm.models.graph_step), the step a CUDA device captures
as a graph per batch-size bucket, run uncaptured on a CPU: the layers' bits for one sequence, their
tokens for several, the sequences' state left as the layers leave it, and nothing in it a capture
cannot hold (a sync, an op sized by the data)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import feed, tiny_engine

from pocketllm.models.graph_step import GraphStep, buckets_for

PROMPTS = [[(7 * i + 3) % 1000 for i in range(n)] for n in (60, 5, 130)]


def _engines(dtype, monkeypatch):
    # The torch forms on both sides (a bf16 CPU run would take the compiled decode ops' path).
    monkeypatch.setenv("POCKETLLM_FUSED_DECODE", "0")
    layers, fixed = tiny_engine(dtype), tiny_engine(dtype)
    for engine in (layers, fixed):
        engine.reserve_slots(4, 200)
        for slot, prompt in enumerate(PROMPTS):
            feed(engine, prompt, slot=slot)
    assert layers.step is None, "the CPU's fp32 / torch-forms run has no step backend of its own"
    fixed.step = GraphStep(fixed, capture=False)
    return layers, fixed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fixed_step_gives_the_layers_bits_for_one_sequence(dtype, monkeypatch):
    # One sequence's decode rows, bucket 1, across a KV block end (64): the layers' logits bit for
    # bit, its state and KV left as theirs, and the greedy row's token theirs.
    layers, fixed = _engines(dtype, monkeypatch)
    pos, token = len(PROMPTS[0]), 11
    for step in range(8):
        want = feed(layers, [token], start=pos)
        direct = fixed.direct_steps
        got = feed(fixed, [token], start=pos).clone()
        assert fixed.direct_steps == direct + 1, "the row did not go to the step"
        assert torch.equal(got, want), f"step {step}: {(got - want).abs().max()}"
        token, pos = int(torch.argmax(want)), pos + 1
    assert fixed.greedy_row(0, pos, token) == layers.greedy_row(0, pos, token)
    _assert_same_state(layers, fixed, torch.equal)
    assert fixed.step.buckets == (1, 2, 4) and buckets_for(5) == (1, 2, 4, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fixed_step_of_several_sequences_gives_the_layers_tokens(dtype, monkeypatch):
    # Three rows (bucket 4, one padding row), then two, then one, each sequence at its own position
    # across KV block ends (64, 128). Each row's logits are the layers' within rounding, not bit
    # for bit: the layers run each sequence's gates alone, and a CPU's elementwise kernels round a
    # transcendental op (softplus) by where an element falls in their vector loop, which moves
    # with the rows beside it (a device's kernels compute every element alike).
    layers, fixed = _engines(dtype, monkeypatch)
    pos = [len(p) for p in PROMPTS]
    tokens = [11, 12, 13]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    for step in range(12):
        live = [0, 1, 2] if step < 6 else [0, 2] if step < 10 else [1]
        spans = [(s, pos[s], torch.tensor([tokens[s]])) for s in live]
        want = layers.run_packed(spans)
        direct = fixed.direct_steps
        got = fixed.run_packed(spans).clone()
        assert fixed.direct_steps == direct + len(live), "the rows did not go to the step"
        torch.testing.assert_close(got, want, **tol)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"step {step}"
        for s, row in zip(live, want):
            tokens[s] = int(torch.argmax(row))
            pos[s] += 1
    _assert_same_state(layers, fixed, lambda a, b: torch.testing.assert_close(a, b, **tol) is None)


def _assert_same_state(layers, fixed, same) -> None:
    """The sequences' GDN state and KV blocks as the layers leave them."""
    for a, b in zip(layers.slots.stacked.values(), fixed.slots.stacked.values()):
        assert same(a.recurrent[:3], b.recurrent[:3]) and same(a.conv[:3], b.conv[:3])
    held = [blk for t in layers.slots.blocks.tables for blk in t.held]
    for a, b in zip(layers.slots.pools, fixed.slots.pools):
        assert same(a.k[held], b.k[held]) and same(a.v[held], b.v[held])


class _Ops(TorchDispatchMode):
    """Every op a step issues, with its argument shapes."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


# What would stop a capture or make a replay wrong: a read back to the host, an output sized by
# the data, or a tensor made from Python data inside the step (lift_fresh: on a device, a copy
# from the host that a capture cannot hold, or holds with the values of the step it captured).
SYNCS = ("_local_scalar_dense", "aten.item", "nonzero", "masked_select", "unique", "aten.equal", "lift_fresh")


def test_the_fixed_step_issues_the_same_ops_whatever_the_rows_hold(monkeypatch):
    _, fixed = _engines(torch.float32, monkeypatch)
    step = fixed.step
    seen = []
    for tokens, positions, slots in (([1, 2, 3], [60, 5, 130], [0, 1, 2]), ([900, 4, 5], [63, 64, 131], [2, 0, 1])):
        step.rows(tokens, positions, slots)  # builds the buffers on the first call
        with torch.inference_mode():
            step.inputs[:, :3] = torch.tensor([tokens, positions, slots])
            with _Ops() as ops:
                step._forward(4)
        seen.append(ops.ops)
        bad = [op for op, _ in ops.ops if any(s in op for s in SYNCS)]
        assert not bad, f"ops a captured step cannot hold: {bad}"
    assert seen[0] == seen[1]


def test_a_bad_token_or_too_many_rows_is_refused_before_the_step_runs(monkeypatch):
    _, fixed = _engines(torch.float32, monkeypatch)
    with pytest.raises(IndexError, match="token id 1000 is outside the embedding's 1000 rows"):
        fixed.step.rows([1000], [60], [0])
    with pytest.raises(ValueError, match="a step of 5 rows"):
        fixed.step.rows([1] * 5, [60] * 5, [0, 1, 2, 3, 0])


def test_reserving_slots_says_the_buckets_the_step_now_holds(monkeypatch):
    """The step line said at load knows no buckets (no slots yet): once the slots are reserved and
    the step prepared for them, the engine says it again with them, once."""
    from pocketllm.engine import decode_step

    class Uncaptured(GraphStep):
        why_not = staticmethod(lambda model: "")

        def __init__(self, engine):
            super().__init__(engine, capture=False)

    monkeypatch.setattr(decode_step, "BACKENDS", (("cuda graph", Uncaptured),))
    engine = tiny_engine(torch.float32)
    said = []
    engine.say = said.append
    assert engine.describe_step() == "decode step: fixed buffers, uncaptured"
    engine.reserve_slots(3, 100)
    assert [line for line in said if line.startswith("decode step: ")] == ["decode step: fixed buffers, uncaptured (B buckets 1,2,3)"]
    engine.reserve_slots(3, 100)
    assert len([line for line in said if line.startswith("decode step: ")]) == 1


class Broken:
    """A step backend for the engine's device that fails to get ready."""

    why_not = staticmethod(lambda model: "")

    def __init__(self, engine):
        pass

    def prepare(self):
        raise RuntimeError("capture failed\nat some depth")


def test_a_step_backend_that_cannot_get_ready_leaves_the_layers_path_saying_why(monkeypatch):
    from pocketllm.engine import decode_step

    monkeypatch.setattr(decode_step, "BACKENDS", (("cuda graph", Broken),))
    engine = tiny_engine(torch.float32)
    said = []
    engine.say = said.append
    assert isinstance(engine.step, Broken)
    engine.reserve_slots(2, 100)
    assert engine.step is None
    assert said[-1] == engine.describe_step() == "decode step: layer by layer (cuda graph failed: RuntimeError: capture failed)"
    # The layers' path serves the rows the backend would have.
    feed(engine, [1, 2, 3])
    assert feed(engine, [4], start=3).shape == (1000,) and engine.direct_steps == 0


def test_at_tp_above_1_a_step_that_cannot_get_ready_ends_the_run(monkeypatch):
    """Every rank must run the same collectives: one rank falling back to the layers' path alone
    would all-reduce other shapes than its peers' step, so at TP>1 the failure is the run's."""
    from types import SimpleNamespace

    from pocketllm.engine import decode_step, runner

    monkeypatch.setattr(decode_step, "BACKENDS", (("cuda graph", Broken),))
    engine = tiny_engine(torch.float32)
    monkeypatch.setattr(runner, "tp", lambda: SimpleNamespace(rank=1, world=2))
    with pytest.raises(RuntimeError) as failure:
        engine.reserve_slots(2, 100)
    assert str(failure.value) == ("decode step: cuda graph failed on rank 1 at TP=2: RuntimeError: capture failed "
                                  "(POCKETLLM_CUDA_GRAPH=0 runs the layers' path)")


def _tp_rank(rank: int, world: int, port: int) -> None:
    """One rank of the TP=2 check below: the layers' engine and the fixed step's, the same
    sequences fed to both, their decode rows compared."""
    from datetime import timedelta

    import torch.distributed as dist

    from conftest import end_process
    from pocketllm.distributed import collective
    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    set_tp(rank, world)
    collective.setup("gloo", "gloo", rank, world, timeout_s=60.0)
    cfg = get_preset("tiny")
    layers, fixed = (Engine(cfg, RandomWeights(cfg, dtype=torch.float32), torch.float32, torch.device("cpu"), RulePolicy()) for _ in range(2))
    for engine in (layers, fixed):
        engine.reserve_slots(4, 200)
        for slot, prompt in enumerate(PROMPTS):
            feed(engine, prompt, slot=slot)
    fixed.step = GraphStep(fixed, capture=False)
    pos, token = len(PROMPTS[0]), 11
    for step in range(5):
        want = feed(layers, [token], start=pos)
        got = feed(fixed, [token], start=pos).clone()
        assert torch.equal(got, want), f"rank {rank}, step {step}: {(got - want).abs().max()}"
        token, pos = int(torch.argmax(want)), pos + 1
    # Rows of three sequences at once (bucket 4): every rank's all-reduces are the same calls. The
    # last row's token is past rank 0's half of the embedding: an id of the whole vocabulary.
    spans = [(0, pos, torch.tensor([token])), (1, len(PROMPTS[1]), torch.tensor([12])), (2, len(PROMPTS[2]), torch.tensor([cfg.vocab_size - 1]))]
    want = layers.run_packed(spans)
    torch.testing.assert_close(fixed.run_packed(spans).clone(), want, rtol=1e-5, atol=1e-5)
    assert fixed.direct_steps == 5 + 3
    collective.close()
    dist.destroy_process_group()
    end_process()


@pytest.mark.timeout(120)
def test_the_fixed_step_at_tp2_gives_the_layers_bits(monkeypatch):
    # What a CUDA device captures at TP>1 (POCKETLLM_CUDA_GRAPH=1 there): the same step with each
    # projection's all-reduce inside it, here uncaptured over gloo.
    from conftest import free_port, start_ranks

    monkeypatch.setenv("POCKETLLM_FUSED_DECODE", "0")
    start_ranks(_tp_rank, 2, 2, free_port())


def test_at_tp_above_1_a_cuda_step_is_captured_only_when_asked():
    from types import SimpleNamespace

    from pocketllm.distributed.state import set_tp
    from pocketllm.models.graph_step import ENV_GRAPH, why_not

    on_cuda = SimpleNamespace(embed=SimpleNamespace(weight=SimpleNamespace(device=torch.device("cuda"))))
    try:
        set_tp(0, 2)
        assert "POCKETLLM_CUDA_GRAPH=1 captures them" in why_not(on_cuda, env={})
        assert why_not(on_cuda, env={ENV_GRAPH: "1"}) == ""
        assert why_not(on_cuda, env={ENV_GRAPH: "0"}) == "POCKETLLM_CUDA_GRAPH=0"
        set_tp(0, 1)
        assert why_not(on_cuda, env={}) == ""
        assert why_not(on_cuda, env={ENV_GRAPH: "0"}) == "POCKETLLM_CUDA_GRAPH=0"
    finally:
        set_tp(0, 1)

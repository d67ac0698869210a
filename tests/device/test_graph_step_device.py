"""The decode step captured as CUDA graphs (pocketllm.models.graph_step) on a CUDA device, against
the layers' path on the same device: the engine chooses it and says so, every bucket's replay
gives the layers' logits within rounding and their greedy tokens, sequences joining and leaving
between steps, and the sequences' state is left as the layers leave it."""

from __future__ import annotations

import pytest
import torch

from device_caps import cuda_count

pytestmark = pytest.mark.skipif(cuda_count() == 0, reason="no CUDA device")

PROMPTS = [[(7 * i + 3) % 1000 for i in range(n)] for n in (60, 5, 130)]


def _engine(monkeypatch, dtype, graphs: bool, max_len: int = 200):
    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    monkeypatch.setenv("POCKETLLM_CUDA_GRAPH", "1" if graphs else "0")
    set_tp(0, 1)
    cfg = get_preset("tiny")
    device = torch.device("cuda", 0)
    engine = Engine(cfg, RandomWeights(cfg, dtype=dtype, device=device), dtype, device, RulePolicy())
    engine.reserve_slots(4, max_len)
    for slot, prompt in enumerate(PROMPTS):
        engine.run_packed([(slot, 0, torch.tensor(prompt))])
    return engine


def assert_same_choice_where_clear(chosen: list[int], want: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    """Each row's greedy choice that of the reference's logits `want` where their top two are
    further apart than twice the difference the comparison allows (atol + rtol x the top logit):
    between two right computations a near tie may go either way (bf16 logits tie exactly at times)."""
    top = want.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > 2 * (atol + rtol * top[:, 0].abs())
    same = torch.tensor(chosen, device=want.device) == want.argmax(-1)
    assert bool(same[clear].all()), (what, same.tolist(), clear.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_captured_steps_give_the_layers_tokens(monkeypatch, dtype):
    layers, graphs = _engine(monkeypatch, dtype, False), _engine(monkeypatch, dtype, True)
    assert layers.step is None and layers.describe_step().startswith("decode step: layer by layer (POCKETLLM_CUDA_GRAPH=0")
    assert graphs.describe_step() == "decode step: cuda graph (B buckets 1,2,4)", graphs.describe_step()
    pos, tokens = [len(p) for p in PROMPTS], [11, 12, 13]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    for step in range(12):
        live = [0, 1, 2] if step < 6 else [0, 2] if step < 10 else [1]
        spans = [(s, pos[s], torch.tensor([tokens[s]])) for s in live]
        want = layers.run_packed(spans)
        direct = graphs.direct_steps
        got = graphs.run_packed(spans)
        assert graphs.direct_steps == direct + len(live)
        torch.testing.assert_close(got, want, **tol)
        assert_same_choice_where_clear(got.argmax(-1).tolist(), want, f"step {step}", **tol)
        for s, row in zip(live, want):
            tokens[s], pos[s] = int(torch.argmax(row)), pos[s] + 1
    # A lone greedy row through the graph: the layers' choice for it, where their logits make it
    # clear (in bf16 the two paths' kernels differ: the graph's Triton rows kernels, the layers'
    # torch conv and fla's recurrent step).
    want = layers.run_packed([(1, pos[1], torch.tensor([tokens[1]]))])
    mine = graphs.greedy_row(1, pos[1], tokens[1])
    assert_same_choice_where_clear([mine], want, "greedy_row", **tol)
    for a, b in zip(layers.slots.stacked.values(), graphs.slots.stacked.values()):
        torch.testing.assert_close(a.recurrent[:3], b.recurrent[:3], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_asked_for_batch_invariance_a_sequences_logits_do_not_depend_on_the_others(monkeypatch, dtype):
    """POCKETLLM_BATCH_INVARIANT=1 on CUDA (the device's batch-invariant shape, cuBLAS and the
    Triton kernels, the step captured at the slots' 4 rows): a prompt prefilled alone and packed
    beside another, then its decode rows alone and beside another sequence's and a prompt chunk,
    get the same logits bit for bit (tests/test_device_pass_shape.py checks the same on CPU)."""
    monkeypatch.setenv("POCKETLLM_BATCH_INVARIANT", "1")
    x, y, z = (torch.tensor(p) for p in ([(5 * i + 1) % 1000 for i in range(40)], PROMPTS[1], [(3 * i) % 1000 for i in range(300)]))

    def fresh():
        return _engine(monkeypatch, dtype, True, max_len=400)

    alone = fresh()
    assert alone.describe_step() == "decode step: cuda graph (every step at 4 rows: batch-invariant)", alone.describe_step()
    first = alone.run_packed([(0, 0, x)])[0]
    steps = [alone.run_packed([(0, 40 + i, torch.tensor([7 + i]))])[0] for i in range(3)]
    busy = fresh()
    assert torch.equal(busy.run_packed([(1, 0, y), (0, 0, x)])[1], first)
    for i in range(3):
        spans = [(0, 40 + i, torch.tensor([7 + i])), (1, len(y) + i, torch.tensor([3 + i]))]
        if i == 1:
            spans.append((2, 0, z[:256]))
        assert torch.equal(busy.run_packed(spans)[0], steps[i]), f"step {i}"
    # Its tokens replayed after a preemption: one pass of its three decode rows beside a prompt,
    # each row through a step of its own, with the bits the steps gave it.
    replayed = fresh()
    replayed.run_packed([(0, 0, x)])
    again = replayed.run_packed([(0, 40 + i, torch.tensor([7 + i])) for i in range(3)] + [(2, 0, z[:256])])
    for i in range(3):
        assert torch.equal(again[i], steps[i]), f"replayed row {i}"


def test_a_pass_beside_a_step_asks_the_device_to_wait_for_nothing(monkeypatch):
    """A server's mixed pass: decode rows through the captured step, then a prompt going into KV
    blocks its slot did not hold, on the layers. Nothing in it waits for the device (a pageable
    host-to-device copy waits for all the stream holds, so the prompt's kernels could not be
    launched while the step's graph ran): torch's sync debug mode raises at any such wait."""
    engine = _engine(monkeypatch, torch.bfloat16, True)
    pos = [len(p) for p in PROMPTS]

    def mixed(k):
        spans = [(s, pos[s] + k, torch.tensor([11 + s])) for s in range(3)]
        return engine.run_packed(spans + [(3, 0, torch.tensor([(5 * i + k) % 1000 for i in range(70 + k)]))])

    mixed(0)  # compiles and first-call setup, outside what is checked
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mixed(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape[0] == 4 and bool(torch.isfinite(out).all())

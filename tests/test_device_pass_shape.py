"""The device's pass shape, forced on a CPU (tiny preset, fp32, in process at TP=1): a prefill pass
issues the same ops per layer whatever the prompt's length (no 256-row segments, no row blocks),
each token mixer runs once per sequence over all of its rows in the pass, and the logits are the
CPU shape's within fp32 rounding. The ops are counted by a dispatch mode over the torch forms a
device runs (layers/context.py: PassShape)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_engine, use_device_ops
from torch.utils._python_dispatch import TorchDispatchMode

from pocketllm.config import FULL
from pocketllm.layers import attention
from pocketllm.layers.context import CPU_PASS, DEVICE_PASS, PassShape
from pocketllm.ops.device import CUSTOM_OPS
from pocketllm.profiling.op_count import copies

torch.set_num_threads(2)

# The most aten ops that may launch work (views not counted) one layer of a device-shaped prefill
# issues, whatever the prompt's length: what the torch forms issue now, fp32, the first layer one op
# fewer (no residual add); an op marked as a view that copied counts. A GDN layer: two residual adds
# with their norms (4), 4 GEMMs with their outputs (8), the conv (window, state, conv1d, SiLU, its
# output made contiguous as the device's kernel writes it), the q/k l2 norm and q's scale (6), the
# gates (4), the gated delta rule as one call (fla's is one on a device) and its state copy, the
# gated norm (4), SiLU-and-multiply (2). Attention: the same adds, norms, GEMMs and SiLU-and-
# multiply (14), the q/k norms (2), rope (14), the KV write (9 index ops, the block ids widened to
# long, 2 index_puts), SDPA, the output gate (2). Each fused kernel registered as a pocketllm::
# custom op counts as one op: tighten these as they replace torch forms.
GDN_LAYER_OPS = 35
ATTENTION_LAYER_OPS = 45
# The same with the device's fused ops (ops/device: the custom ops, Triton kernels on CUDA, one op
# each): a GDN layer's two residual adds with their norms, conv, q/k l2 norm, gates, gated norm and
# SiLU-and-multiply one op each (7), its GEMMs (8), the gated delta rule and its state copy (2);
# attention's adds and norms, q/k norms, rope, KV write and SiLU-and-multiply one op each (8), its
# GEMMs (8), SDPA, the output gate (2).
FUSED_GDN_LAYER_OPS = 17
FUSED_ATTENTION_LAYER_OPS = 19
# 70 rows: one 256-row chunk; 600 and 1100: three and five.
LENGTHS = (70, 600, 1100)


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(torch.float32)
    engine.reserve_slots(2, 1200)
    return engine


@pytest.fixture
def device_shaped(engine, monkeypatch):
    monkeypatch.setattr(engine, "pass_shape", DEVICE_PASS)
    return engine


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return (torch.arange(n) * 37 + 11 * seed + 5) % 1000


class OpCounter(TorchDispatchMode):
    """Counts the aten ops issued that may launch work (views, which only describe a tensor, not
    counted; an op marked as a view that copied is), but those of a call it takes as one (while
    paused)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and (not func.is_view or copies(func, args, out)):
            self.ops += 1
        return out


@dataclasses.dataclass
class PassCount:
    ops: list[int]  # per layer
    mixer_rows: list[list[int]]  # per layer, the rows of each gated-delta or attention call


def count_pass(engine, spans) -> PassCount:
    """The ops each layer of one pass issues and the rows each of its mixer calls gets."""
    layers = engine.model.layers
    counter = OpCounter()
    got = PassCount([0] * len(layers), [[] for _ in layers])
    at = [0, 0]  # the layer running, the count where it began

    def begin(i):
        at[:] = [i, counter.ops]

    def end(i):
        got.ops[i] = counter.ops - at[1]

    def one_call(fn):
        def call(q, *args, **kwargs):
            got.mixer_rows[at[0]].append(q.shape[0])
            counter.ops += 1
            counter.paused = True
            try:
                return fn(q, *args, **kwargs)
            finally:
                counter.paused = False

        return call

    def attended(q, *args, **kwargs):
        got.mixer_rows[at[0]].append(q.shape[0])
        return cached_attention(q, *args, **kwargs)

    cached_attention = attention.cached_attention
    hooks = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "cached_attention", attended)
        for i, layer in enumerate(layers):
            if layer.kind != FULL:
                patch.setattr(layer.mixer, "kernel", dataclasses.replace(layer.mixer.kernel, prefill=one_call(layer.mixer.kernel.prefill)))
            hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: begin(i)))
            hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: end(i)))
        try:
            with counter:
                engine.run_packed(spans)
        finally:
            for h in hooks:
                h.remove()
    return got


def bound(engine, i: int) -> int:
    return ATTENTION_LAYER_OPS if engine.model.layers[i].kind == FULL else GDN_LAYER_OPS


def test_the_pass_shape_is_chosen_by_the_device():
    assert PassShape.for_device("cpu") is CPU_PASS and PassShape.for_device(torch.device("cpu")) is CPU_PASS
    for device in ("cuda", "cuda:1", "npu", torch.device("meta")):
        assert PassShape.for_device(device) is DEVICE_PASS
    assert CPU_PASS.invariant_cuts and CPU_PASS.cpu_forms and not CPU_PASS.whole_sequences
    assert not DEVICE_PASS.invariant_cuts and not DEVICE_PASS.cpu_forms and DEVICE_PASS.whole_sequences
    assert tiny_engine(torch.float32).pass_shape is CPU_PASS


def test_a_device_shaped_prefill_issues_the_same_ops_per_layer_at_any_prompt_length(device_shaped):
    counts = {n: count_pass(device_shaped, [(0, 0, prompt(n))]) for n in LENGTHS}
    for n, c in counts.items():
        # One call of each mixer over all the prompt's rows.
        assert c.mixer_rows == [[n]] * len(c.ops), n
        for i, ops in enumerate(c.ops):
            assert ops <= bound(device_shaped, i), f"layer {i} ({device_shaped.model.layers[i].kind}) issued {ops} ops for {n} rows"
    assert counts[70].ops == counts[600].ops == counts[1100].ops, {n: c.ops for n, c in counts.items()}


def test_with_the_devices_fused_ops_a_layer_issues_a_few_ops_at_any_prompt_length(device_shaped, monkeypatch):
    # The custom ops a CUDA device runs as Triton kernels, here running their torch forms.
    use_device_ops(device_shaped.model, CUSTOM_OPS, monkeypatch.setattr)
    counts = {n: count_pass(device_shaped, [(0, 0, prompt(n))]).ops for n in (70, 600)}
    for i, layer in enumerate(device_shaped.model.layers):
        most = FUSED_ATTENTION_LAYER_OPS if layer.kind == FULL else FUSED_GDN_LAYER_OPS
        assert counts[70][i] == counts[600][i] <= most, counts


def test_a_device_shaped_pass_runs_each_mixer_once_per_sequence(device_shaped):
    # Sequence 0 in two consecutive spans (its positions 0..300 and 300..600, three chunks' worth
    # in all), then sequence 1: one call per sequence, of all its rows.
    a, b = prompt(600), prompt(90, 1)
    c = count_pass(device_shaped, [(0, 0, a[:300]), (0, 300, a[300:]), (1, 0, b)])
    assert c.mixer_rows == [[600, 90]] * len(c.ops)


def test_the_cpu_shape_cuts_a_prompt_into_chunks_where_the_device_shape_does_not(engine):
    # What the counts above tell apart: the CPU's batch-invariant pass runs a 600-row prompt as
    # three segments, and its ops grow with them.
    c = count_pass(engine, [(0, 0, prompt(600))])
    assert c.mixer_rows == [[256, 256, 88]] * len(c.ops)
    short = count_pass(engine, [(0, 0, prompt(70))])
    assert all(long > one for long, one in zip(c.ops, short.ops))


def test_a_device_shaped_pass_gives_the_cpu_shaped_logits(engine, monkeypatch):
    ids = prompt(600)
    cpu = engine.run_packed([(0, 0, ids)], all_logits=True)
    monkeypatch.setattr(engine, "pass_shape", DEVICE_PASS)
    device = engine.run_packed([(0, 0, ids)], all_logits=True)
    # The same arithmetic, summed in another order (the conv whole, the gated delta rule's chunks
    # not restarted at 256-row segment ends).
    torch.testing.assert_close(device, cpu, atol=5e-5, rtol=1e-5)
    assert torch.equal(device.argmax(-1), cpu.argmax(-1))


def _device_step_engine(monkeypatch, prompts=(), shape=DEVICE_PASS, max_len: int = 200, device_kernels: bool = False):
    """A tiny fp32 engine in a device's pass shape (`shape`) with the device's custom ops and the
    step backend (graph_step, uncaptured), 4 slots of max_len, the prompts fed into slots 0..;
    with device_kernels, the projection kernels a device binds (device_like_kernels)."""
    from conftest import device_engine, feed
    from pocketllm.models.graph_step import GraphStep

    monkeypatch.setenv("POCKETLLM_FUSED_DECODE", "0")
    engine = device_engine(CUSTOM_OPS, shape=shape, max_len=max_len)
    if device_kernels:
        engine.kernels = device_like_kernels(engine.model.projection_weights(), 4)
        engine.model.bind_kernels(engine.kernels)
    for slot, ids in enumerate(prompts):
        feed(engine, ids, slot=slot)
    engine.step = GraphStep(engine, capture=False)
    return engine


def test_a_device_shaped_decode_step_reads_each_attention_layers_cache_in_one_op(monkeypatch):
    """Decode rows of three sequences through the step (graph_step, uncaptured) in the device's
    shape, with the device's custom ops (their torch forms on a CPU, which test_device_ops.py
    holds them to): each full-attention layer's read of the paged cache is one op,
    pocketllm::decode_attention_rows, its write one op, pocketllm::write_kv_rows, and each GDN
    layer's conv one op, pocketllm::causal_conv1d_rows_indexed_ (a Triton kernel each on CUDA)."""
    from pocketllm.profiling.op_count import count_ops

    prompts = [prompt(n, seed) for seed, n in enumerate((60, 5, 130))]
    engine = _device_step_engine(monkeypatch, prompts)
    logits, count = count_ops(engine.run_packed, [(slot, len(ids), torch.tensor([7 + slot])) for slot, ids in enumerate(prompts)])
    assert engine.direct_steps == 3, "the rows did not go to the step"
    full = sum(layer.kind == FULL for layer in engine.model.layers)
    assert count.kernels["pocketllm::decode_attention_rows"] == full and logits.isfinite().all()
    assert count.kernels["pocketllm::write_kv_rows"] == full and not count.kernels["aten::index_put_"]
    assert count.kernels["pocketllm::causal_conv1d_rows_indexed_"] == len(engine.model.layers) - full


def test_a_device_pass_of_decode_rows_beside_a_prompt_runs_the_rows_as_a_step(monkeypatch):
    """Two sequences' decode rows and a new prompt in one pass: the rows go through the step
    backend (a captured graph's replay on CUDA) as a step of the two rows alone would, the prompt
    through the layers as a pass of it alone would, their logits in the spans' order."""
    prompts = [prompt(n, seed) for seed, n in enumerate((40, 9))]
    new = prompt(23, 5)
    spans = [(0, 40, torch.tensor([7])), (2, 0, new), (1, 9, torch.tensor([8]))]
    mixed_engine = _device_step_engine(monkeypatch, prompts)
    mixed = mixed_engine.run_packed(spans)
    assert mixed_engine.direct_steps == 2, "the decode rows did not go to the step"
    apart_engine = _device_step_engine(monkeypatch, prompts)
    rows = apart_engine.run_packed([spans[0], spans[2]])
    alone = apart_engine.run_packed([spans[1]])
    assert torch.equal(mixed[[0, 2]], rows) and torch.equal(mixed[1], alone[0])
    # The same model as the one pass of the layers, within fp32 rounding.
    layers_engine = _device_step_engine(monkeypatch, prompts)
    layers_engine.step = None
    torch.testing.assert_close(mixed, layers_engine.run_packed(spans), atol=5e-5, rtol=1e-5)
    # Beside a prompt whose every row's logits are read (a request scoring its prompt), the rows
    # still go through the step, with the same bits; the prompt's rows are those of a pass of it
    # alone, its last row the same as without them.
    every_engine = _device_step_engine(monkeypatch, prompts)
    every = every_engine.run_packed(spans, all_logits=True)
    assert every_engine.direct_steps == 2 and every.shape[0] == 2 + new.shape[0]
    assert torch.equal(every[0], rows[0]) and torch.equal(every[-1], rows[1])
    assert torch.equal(every[1 : 1 + new.shape[0]], _device_step_engine(monkeypatch, prompts).run_packed([spans[1]], all_logits=True))
    assert torch.equal(every[new.shape[0]], alone[0])
    # A sequence with two decode rows in the pass (its second row needs the first's state) takes
    # two steps, one a row, with the bits of two passes of a row each.
    both = _device_step_engine(monkeypatch, prompts)
    two = both.run_packed([(0, 40, torch.tensor([7])), (0, 41, torch.tensor([9])), (2, 0, new)])
    assert both.direct_steps == 2
    one_by_one = _device_step_engine(monkeypatch, prompts)
    one_by_one.run_packed([(0, 40, torch.tensor([7]))])
    assert torch.equal(two[0], rows[0]) and torch.equal(two[1], one_by_one.run_packed([(0, 41, torch.tensor([9]))])[0])


def test_a_devices_kernels_read_a_steps_weights_once():
    """A device's kernel set binds a few-row call to one torch.mm of all its rows, asked for batch
    invariance or not: the CPU's way to it, the one-row kernel on each row in turn where no
    few-row kernel sums like it, would read the weights once per row of a step (8 times at 8)."""
    from pocketllm.ops.registry import ENV_INVARIANT, KernelSet, kernel_set

    w = torch.empty(64, 32, dtype=torch.bfloat16, device="meta")
    for env in ({}, {ENV_INVARIANT: "1"}):
        kernels = KernelSet.choose([w], env=env)
        kernels.choose_few([w], 8)
        assert not kernels.invariant
        small = kernels.bind(w)._small
        assert [(e[0].__name__, e[2]) for e in small[2:]] == [("mm", kernel_set._ROWS)] * 7
    cpu = KernelSet(env={}, device_type="cpu")
    assert cpu.invariant


def test_a_device_is_batch_invariant_only_where_asked_and_then_takes_the_invariant_shape():
    from pocketllm.layers.context import DEVICE_INVARIANT_PASS
    from pocketllm.ops.registry import ENV_INVARIANT, batch_invariant

    assert batch_invariant({}, "cpu") and not batch_invariant({}, "cuda") and not batch_invariant({}, "npu")
    assert batch_invariant({ENV_INVARIANT: "1"}, "cuda") and not batch_invariant({ENV_INVARIANT: "0"}, "cpu")
    assert PassShape.for_device("cuda", invariant=True) is DEVICE_INVARIANT_PASS
    assert PassShape.for_device("cuda:1") is DEVICE_PASS and PassShape.for_device("cpu", invariant=False) is CPU_PASS
    assert DEVICE_INVARIANT_PASS.invariant_cuts and DEVICE_INVARIANT_PASS.fixed_step and not DEVICE_INVARIANT_PASS.cpu_forms


def device_like_kernels(weights, count: int):
    """The projection kernels a device binds, on CPU weights: the kinds' defaults (torch.mv for one
    row, torch.mm for a few and for many), a few-row call one call of all its rows (a device's
    KernelSet makes no per-row-order promise; test_a_devices_kernels_read_a_steps_weights_once)."""
    from pocketllm.ops.registry import ENV_INVARIANT, ENV_KERNELS, KernelSet

    env = {ENV_INVARIANT: "0", ENV_KERNELS: "one-row=mv,few-row=mm,many-row=mm"}
    kernels = KernelSet.choose(weights, env=env)
    kernels.choose_few(weights, count)
    return kernels


def test_in_a_devices_invariant_shape_a_sequences_logits_do_not_depend_on_the_others(monkeypatch):
    """A prompt prefilled alone and packed beside another prompt; then its decode rows alone and
    beside another sequence's decode rows and a third's prompt chunk (a pass the engine splits):
    the same logits bit for bit. Every decode step runs at the slots' 4 rows."""
    from pocketllm.layers.context import DEVICE_INVARIANT_PASS

    def engine():
        return _device_step_engine(monkeypatch, shape=DEVICE_INVARIANT_PASS, max_len=400, device_kernels=True)

    x, y, z = prompt(40), prompt(9, 1), prompt(300, 2)
    alone = engine()
    first = alone.run_packed([(0, 0, x)])[0]
    steps = [alone.run_packed([(0, 40 + i, torch.tensor([7 + i]))])[0] for i in range(3)]
    assert alone.step.buckets == (4,) and alone.step.describe().endswith("(every step at 4 rows: batch-invariant)")

    busy = engine()
    packed = busy.run_packed([(1, 0, y), (0, 0, x)])
    assert torch.equal(packed[1], first)
    busy_steps = []
    for i in range(3):
        spans = [(0, 40 + i, torch.tensor([7 + i])), (1, 9 + i, torch.tensor([3 + i]))]
        if i == 1:
            spans.append((2, 0, z[:256]))  # a prompt chunk beside the decode rows
        busy_steps.append(busy.run_packed(spans)[0])
    for mine, theirs in zip(busy_steps, steps, strict=True):
        assert torch.equal(mine, theirs)

    # Its chosen tokens replayed after a preemption (the scheduler gives them as one-row spans of
    # its slot in one pass), beside another sequence's decode row and a third's prompt: each row
    # goes through a step of its own, with the bits the steps gave it.
    replayed = engine()
    replayed.run_packed([(0, 0, x)])
    replayed.run_packed([(1, 0, y)])
    spans = [(0, 40 + i, torch.tensor([7 + i])) for i in range(3)] + [(1, 9, torch.tensor([3])), (2, 0, z[:256])]
    before = replayed.direct_steps
    again = replayed.run_packed(spans)
    assert replayed.direct_steps - before == 4  # three steps: slot 0's rows and, in the first, slot 1's
    for mine, theirs in zip(again[:3], steps, strict=True):
        assert torch.equal(mine, theirs)


def test_a_devices_invariant_step_runs_the_devices_forms_over_all_its_rows(monkeypatch):
    """Batch-invariant on a device, a step's norms and SiLU-and-multiply take the device's forms
    over all its rows at once (each row's bits are its own there), as in the default shape: not
    the CPU's one-row torch forms row by row, five ops a row."""
    from pocketllm.layers.context import DEVICE_INVARIANT_PASS
    from pocketllm.profiling.op_count import count_ops

    prompts = [prompt(n, seed) for seed, n in enumerate((60, 5, 130))]
    counts = []
    for shape in (DEVICE_PASS, DEVICE_INVARIANT_PASS):
        engine = _device_step_engine(monkeypatch, prompts, shape=shape, device_kernels=True)
        _, count = count_ops(engine.run_packed, [(slot, len(ids), torch.tensor([7 + slot])) for slot, ids in enumerate(prompts)])
        assert engine.direct_steps == 3, shape.name
        counts.append(count.kernels)
    default, invariant = counts
    assert invariant == default, {op: (default[op], invariant[op]) for op in set(default) | set(invariant) if default[op] != invariant[op]}


def test_a_devices_invariant_pass_without_kernels_takes_each_rows_forms_as_a_cpu_does():
    """The device's kernels give each row its own bits in a call of many rows; without them (the
    torch forms: no Triton, a kernel that failed its probe, an NPU) a batch-invariant pass runs its
    rows' norms as a CPU's do, each as it would alone. A pass that is not invariant takes the
    device's forms either way."""
    from pocketllm.layers.context import DEVICE_INVARIANT_PASS, part_forms_on_cpu

    assert not part_forms_on_cpu(DEVICE_INVARIANT_PASS, True, device_kernels=True)
    assert part_forms_on_cpu(DEVICE_INVARIANT_PASS, True, device_kernels=False)
    assert not part_forms_on_cpu(DEVICE_PASS, False, device_kernels=False)
    assert part_forms_on_cpu(CPU_PASS, True, device_kernels=False) and part_forms_on_cpu(CPU_PASS, False, device_kernels=True)


def test_the_replay_check_runs_each_row_in_a_slot_of_its_own_and_puts_the_padding_back(monkeypatch):
    """A captured step is checked by replaying its first bucket against the same step uncaptured.
    Batch-invariant, that bucket is all the slots' rows: in the padding slot alone they would race
    on its conv window and recurrent state on a GPU (one row's read before or after another's
    write) and the check would fail at random. Each row runs in a real slot of its own from a
    cleared state, both times, and the buffers hold the padding slot again after."""
    from pocketllm.layers.context import DEVICE_INVARIANT_PASS

    engine = _device_step_engine(monkeypatch, shape=DEVICE_INVARIANT_PASS)
    step = engine.step
    step.prepare()
    (bucket,) = step.buckets
    assert bucket == 4
    seen = []
    forward = step._forward

    def recorded(rows):
        seen.append(step.inputs[2, :rows].tolist())
        # Every slot the rows run in starts cleared: a state left from before would show here.
        for states in engine.slots.stacked.values():
            for slot in seen[-1]:
                assert not states.slot(slot).recurrent.any() and not states.slot(slot).conv.any()
        return forward(rows)

    class Replay:  # a captured graph writes the step's output buffer in place
        def replay(self):
            step.out[bucket].copy_(recorded(bucket))

    # Dirty states (a reserve reuses the stacked states it has room in) are cleared for the check.
    for states in engine.slots.stacked.values():
        states.recurrent.fill_(0.5)
        states.conv.fill_(0.5)
    step._forward = recorded
    step.graphs[bucket] = Replay()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with torch.inference_mode():  # as prepare() checks it
        step.out[bucket] = forward(bucket)
        assert step.replay_disagrees(bucket) == ""
    assert seen == [[0, 1, 2, 3]] * 2
    assert step.inputs[2].tolist() == [engine.slots.padding] * bucket
    for states in engine.slots.stacked.values():
        assert not states.recurrent[:bucket].any() and not states.conv[:bucket].any()

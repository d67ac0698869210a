"""The gated delta rule's decode step of B sequences on the stacked state, on CPU: its Triton kernel
under the interpreter (interpreted_gated_delta_rows.py, run with the other interpreted files by
test_device_ops.py) and compiled for
a GPU (sm_90); the custom op pocketllm::gated_delta_rows_indexed_ one op, the torch form off CUDA,
its fake form as torch checks it; the GDN kernel seam that gives it to the layers (the torch form
on CPU, the op on CUDA once its probe passes); a decode step whose recurrence is the op, one op per
layer, with the torch form's bits. tests/device/test_gated_delta_rows_on_cuda.py runs it on CUDA."""

from __future__ import annotations

import torch

import pocketllm.ops.gated_delta.backends as backends
from conftest import feed, tiny_engine
from gated_delta_rows_cases import MODEL, SMALL, rows_inputs, untouched
from triton_on_cpu import compiled_for_gpu
from pocketllm.ops.gated_delta.indexed import gated_delta_rows_indexed_op, gated_delta_rows_indexed_torch_, gathered
from pocketllm.ops.gated_delta.recurrent import gated_delta_rows_torch_
from pocketllm.profiling.op_count import count_ops

CPU = torch.device("cpu")
OP = "pocketllm::gated_delta_rows_indexed_"


def test_the_kernel_compiles_for_a_gpu(tmp_path, monkeypatch):
    """The interpreter runs some things the compiler refuses: compile the launches for sm_90, at
    odd head dims with v in bf16 and at the model's with v in fp32."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from pocketllm.ops.device.kernels import gated_delta_rows

    compiled = []
    for case, dtype in ((SMALL[2], torch.bfloat16), (MODEL, torch.float32)):
        compiled += compiled_for_gpu(gated_delta_rows, gated_delta_rows.gated_delta_rows_indexed_, *rows_inputs(*case, dtype=dtype))
    assert len(compiled) == 2 and all(k.asm["cubin"] for k in compiled)


def test_the_torch_form_is_the_gathered_step_put_back():
    q, k, v, g, beta, state, slots = rows_inputs(*SMALL[1])
    before, theirs = state.clone(), state.clone()
    out = gated_delta_rows_indexed_torch_(q, k, v, g, beta, state, slots)
    rows = theirs[slots]
    assert torch.equal(out, gated_delta_rows_torch_(q, k, v, g, beta, rows)) and torch.equal(state[slots], rows)
    assert untouched(state, before, slots) == [1, 2]
    again = before.clone()
    assert torch.equal(gathered(gated_delta_rows_torch_)(q, k, v, g, beta, again, slots), out) and torch.equal(again, state)


def test_the_custom_op_is_one_op_and_the_torch_form_off_cuda():
    mine, theirs = rows_inputs(*SMALL[1], dtype=torch.bfloat16), rows_inputs(*SMALL[1], dtype=torch.bfloat16)
    out, count = count_ops(gated_delta_rows_indexed_op, *mine)
    assert count.kernels == {OP: 1}, count.ops
    assert torch.equal(out, gated_delta_rows_indexed_torch_(*theirs)) and torch.equal(mine[5], theirs[5])


def test_the_custom_op_passes_torchs_opcheck():
    """The schema (state declared mutated, nothing else) and the fake form against the real call."""
    op = torch.ops.pocketllm.gated_delta_rows_indexed_.default
    torch.library.opcheck(op, rows_inputs(*SMALL[1]), test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_the_custom_op_in_one_graph():
    mine, theirs = rows_inputs(*SMALL[1]), rows_inputs(*SMALL[1])
    out = torch.compile(gated_delta_rows_indexed_op, backend="aot_eager", fullgraph=True)(*mine)
    assert torch.equal(out, gated_delta_rows_indexed_op(*theirs)) and torch.equal(mine[5], theirs[5])


def test_the_seam_gives_the_torch_form_on_cpu(monkeypatch):
    monkeypatch.setattr(backends, "_selected", {})
    for dtype in (torch.float32, torch.bfloat16):
        kernel = backends.select_gdn_kernel(CPU, dtype, env={})
        assert kernel.decode_rows_indexed_ is gated_delta_rows_indexed_torch_ and "decode rows" not in kernel.reason


def test_the_op_is_taken_once_its_probe_passes():
    # On CPU the op runs its torch form: the probe passes and the kernel takes it.
    kernel = backends.torch_kernel("chunk", "planned")
    taken = backends.with_triton_decode_rows(kernel, CPU, torch.bfloat16)
    assert taken.decode_rows_indexed_ is gated_delta_rows_indexed_op and taken.prefill is kernel.prefill
    assert taken.describe() == "chunk (planned; decode rows: triton, state in place)"


def test_an_op_failing_its_probe_leaves_the_gathered_rows_saying_why():
    kernel = backends.torch_kernel("chunk", "planned")

    def off(q, k, v, g, beta, state, slots):
        out = gated_delta_rows_indexed_torch_(q, k, v, g, beta, state, slots)
        state[slots] *= 1.01
        return out

    def strays(q, k, v, g, beta, state, slots):
        state[1] += 1
        return gated_delta_rows_indexed_torch_(q, k, v, g, beta, state, slots)

    def broken(*args):
        raise RuntimeError("out of resource: shared memory\nmore")

    for op, why in ((off, "disagrees with the reference: decode rows state"), (strays, "changed a slot outside the step's rows"),
                    (broken, "RuntimeError: out of resource: shared memory)")):
        kept = backends.with_triton_decode_rows(kernel, CPU, torch.float32, op=op)
        assert kept.decode_rows_indexed_ is gated_delta_rows_indexed_torch_
        assert kept.reason.startswith("planned; decode rows gathered: the triton kernel failed its probe (") and why in kept.reason, kept.reason


def test_a_cuda_kernel_is_offered_the_op(monkeypatch):
    """select_gdn_kernel offers the op on CUDA only (here no GPU: its probe fails, saying why)."""
    monkeypatch.setattr(backends, "_selected", {})
    offered = []
    monkeypatch.setattr(backends, "with_triton_decode_rows", lambda kernel, device, dtype, layout: offered.append(device.type) or kernel)
    backends.select_gdn_kernel(CPU, torch.float32, env={})
    backends.select_gdn_kernel(torch.device("cuda"), torch.float32, env={})
    assert offered == ["cuda"]
    monkeypatch.undo()
    monkeypatch.setattr(backends, "_selected", {})
    kernel = backends.select_gdn_kernel(torch.device("cuda"), torch.float32, env={})
    assert kernel.decode_rows_indexed_ is gated_delta_rows_indexed_torch_ and "decode rows gathered" in kernel.reason


def test_a_decode_step_runs_the_recurrence_as_one_op_per_layer(monkeypatch):
    """The captured step's forward (uncaptured) with each GDN layer's recurrence the custom op: one
    op per layer where the torch form gathers and puts back, the same logits and state bits."""
    from dataclasses import replace

    from pocketllm.layers.gdn import GatedDeltaNet
    from pocketllm.models.graph_step import GraphStep

    monkeypatch.setenv("POCKETLLM_FUSED_DECODE", "0")
    engines = []
    for use_op in (False, True):
        engine = tiny_engine(torch.float32)
        engine.reserve_slots(4, 200)
        for slot, n in enumerate((9, 5, 13)):
            feed(engine, [(7 * i + 3) % 1000 for i in range(n)], slot=slot)
        mixers = [m for m in engine.model.modules() if isinstance(m, GatedDeltaNet)]
        if use_op:
            for m in mixers:
                m.kernel = replace(m.kernel, decode_rows_indexed_=gated_delta_rows_indexed_op)
        step = GraphStep(engine, capture=False)
        step.prepare()
        # Three sequences' rows out of slot order, bucket 4: a padding row too.
        logits, count = count_ops(step.rows, [11, 12, 13], [9, 5, 13], [2, 0, 1])
        engines.append((engine, logits, count, len(mixers)))
    (plain, want, torch_count, layers), (fused, got, op_count, _) = engines
    assert layers and op_count.kernels[OP] == layers and OP not in torch_count.kernels
    # The recurrent state's put-back gone (the conv window's stays): one index_copy_ a layer, not two.
    assert torch_count.kernels["aten::index_copy_"] == 2 * layers and op_count.kernels["aten::index_copy_"] == layers
    assert torch.equal(got, want)
    for a, b in zip(plain.slots.stacked.values(), fused.slots.stacked.values()):
        assert torch.equal(a.recurrent, b.recurrent)

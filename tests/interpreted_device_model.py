"""The whole model in a device's pass shape with every device kernel (pocketllm/ops/device/kernels,
the GDN decode rows' kernel too) on CPU under Triton's interpreter, against the same engine with the
kernels' torch forms, in two halves: prompts read (one in two passes), then decode steps of several
sequences through the step backend (graph_step, uncaptured), as a CUDA device runs them. Each kernel
is held to its torch form op by op elsewhere (interpreted_device_kernels.py); this holds them in
place, fed what the layers hand them (their views, strides, dtypes, the slots' stacked state and
paged KV). Runs only in a process started with TRITON_INTERPRET=1 (tests/triton_on_cpu.py says
why): test_device_ops.py runs it so, and so can a developer:

    TRITON_INTERPRET=1 python -m pytest -q tests/interpreted_device_model.py"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import device_engine, feed

from pocketllm.models.graph_step import GraphStep
from pocketllm.ops.device import TORCH_OPS, DeviceOps
from pocketllm.ops.device.kernels import (add_rms_norm, causal_conv, causal_conv_rows, decode_attention, gated_delta_rows, gated_norm, gdn_gates,
                                          kv_write, qk_l2_norm, rope, silu_mul)
from pocketllm.presets import get_preset

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this file with TRITON_INTERPRET=1 from the start of the process (tests/test_device_ops.py does)")

# The kernels themselves, where a CUDA device's custom ops launch them.
KERNEL_OPS = DeviceOps(
    add_rms_norm.add_rms_norm, gated_norm.rms_norm_gated, qk_l2_norm.qk_l2_norm, gdn_gates.gdn_gates, silu_mul.silu_mul,
    causal_conv.causal_conv1d_prefill_, causal_conv_rows.causal_conv1d_rows_indexed_, rope.apply_rotary, kv_write.write_kv,
    kv_write.write_kv_rows, decode_attention.decode_attention_rows, True, "interpreted",
)
# Under the interpreter a kernel costs a millisecond or more a program (the norms run a program a
# row and head), so the check is cut in two about equal halves, each in its own process of
# test_device_ops.py's two: the residual and gated norms' kernels in place (the torch forms for the
# rest), then every other kernel.
NORMS = ("add_rms_norm", "rms_norm_gated")
HALVES = {
    "norms": dataclasses.replace(TORCH_OPS, **{f: getattr(KERNEL_OPS, f) for f in NORMS}),
    "the-rest": dataclasses.replace(KERNEL_OPS, **{f: getattr(TORCH_OPS, f) for f in NORMS}),
}
# Short prompts for the same reason: one of a row, the others within a KV block.
PROMPTS = [[(37 * i + 11 * s + 5) % 1000 for i in range(n)] for s, n in enumerate((30, 1, 7))]
CUT = 19
TOL = dict(atol=3e-2, rtol=2e-2)
# The tiny preset with half its GDN heads (still two value heads to each key head).
CFG = dataclasses.replace(get_preset("tiny"), linear_num_key_heads=2, linear_num_value_heads=4)


def _engine(ops: DeviceOps):
    """A tiny bf16 engine (a device's default dtype) in the device's pass shape with `ops` (and with the rest of the kernels,
    the GDN decode rows' kernel), 4 slots, the prompts fed into slots 0..2, the step backend
    uncaptured."""
    engine = device_engine(ops, torch.bfloat16, cfg=CFG, invariant=False)
    for m in engine.model.modules():
        if ops is HALVES["the-rest"] and hasattr(m, "kernel") and hasattr(m.kernel, "decode_rows_indexed_"):
            m.kernel = dataclasses.replace(m.kernel, decode_rows_indexed_=gated_delta_rows.gated_delta_rows_indexed_)
    # The first prompt in two passes, the second going on from the first's KV, conv and GDN state
    # (as a prompt's later chunk, or a prompt after a prefix-cache hit, does).
    first = PROMPTS[0]
    feed(engine, first[:CUT], slot=0)
    prompt_logits = [feed(engine, first[CUT:], start=CUT, slot=0)]
    prompt_logits += [feed(engine, ids, slot=slot) for slot, ids in enumerate(PROMPTS[1:], start=1)]
    engine.step = GraphStep(engine, capture=False)
    return engine, torch.stack(prompt_logits)


@pytest.mark.parametrize("half", list(HALVES))
def test_the_model_on_the_device_kernels_gives_the_torch_forms_logits_and_tokens(half, monkeypatch):
    monkeypatch.setenv("POCKETLLM_FUSED_DECODE", "0")
    # The projection kernels a device binds (torch's mv and mm): nothing measured, which under
    # the interpreter's load would be measured again at every engine.
    monkeypatch.setenv("POCKETLLM_KERNELS", "one-row=mv,few-row=mm,many-row=mm")
    kernels, prompt_k = _engine(HALVES[half])
    forms, prompt_t = _engine(TORCH_OPS)
    # In bf16 each kernel rounds where its torch form rounds, and is held to it within an ulp op
    # by op (fp32 sums in another order may move a bit): so the logits within a few bf16 ulps of
    # the hidden state's, and the same tokens. (As the code stands they are equal bit for bit.)
    torch.testing.assert_close(prompt_k, prompt_t, **TOL)
    tokens = prompt_t.argmax(-1).tolist()
    pos = [len(p) for p in PROMPTS]
    for step in range(4):
        live = [0, 1, 2] if step < 3 else [2, 0]  # the slots in another order, one fewer
        spans = [(s, pos[s], torch.tensor([tokens[s]])) for s in live]
        got, want = kernels.run_packed(spans).clone(), forms.run_packed(spans).clone()
        torch.testing.assert_close(got, want, **TOL)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"step {step}"
        for s, row in zip(live, want):
            tokens[s], pos[s] = int(row.argmax()), pos[s] + 1
    assert kernels.direct_steps == forms.direct_steps == 11, "the decode rows did not go to the step"
    # The sequences' state as the torch forms leave it.
    for a, b in zip(kernels.slots.stacked.values(), forms.slots.stacked.values()):
        torch.testing.assert_close(a.recurrent[:3], b.recurrent[:3], **TOL)
        torch.testing.assert_close(a.conv[:3], b.conv[:3], **TOL)

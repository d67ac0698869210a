"""The gated delta rule's state through the passes a server makes, on CUDA with the kernel the
engine picks there (fla where it imports): several prompts in one pass (one of them in two spans
of its slot), a prompt carried across passes beside decode rows, and a slot restored from another's
snapshot. Against the same engine on the torch chunked kernel, both in bf16, and a CPU engine in
fp32 on the same weights as the truth: the device's kernel may be no further from it than the torch
one's rounding allows. A state read from or written to the wrong slot, or dropped between passes,
is off by the whole of a prompt's contribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from device_caps import cuda_count, fla_installed

pytestmark = pytest.mark.skipif(cuda_count() < 1, reason="needs 1 cuda device(s)")

# More value heads than key heads (fla's grouped heads), and prompts past fla's 64-row chunks.
PROMPTS = [[(37 * i + 11 * s + 5) % 1000 for i in range(n)] for s, n in enumerate((150, 70, 9))]


def _engine(monkeypatch, device: str, dtype, gdn: str | None):
    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    monkeypatch.setenv("POCKETLLM_CUDA_GRAPH", "0")
    if gdn is None:
        monkeypatch.delenv("POCKETLLM_GDN_KERNEL", raising=False)
    else:
        monkeypatch.setenv("POCKETLLM_GDN_KERNEL", gdn)
    set_tp(0, 1)
    cfg = dataclasses.replace(get_preset("tiny"), linear_num_key_heads=2, linear_num_value_heads=4)
    # The weights drawn on the host and rounded to bf16 for every engine: the same numbers.
    engine = Engine(cfg, RandomWeights(cfg, dtype=torch.bfloat16), dtype, torch.device(device), RulePolicy())
    engine.reserve_slots(4, 300)
    return engine


def _passes(engine) -> list[torch.Tensor]:
    p, t = PROMPTS, lambda ids: torch.tensor(ids)  # noqa: E731
    out = [
        # Three prompts in one pass, the first in two spans of its slot.
        engine.run_packed([(0, 0, t(p[0][:17])), (1, 0, t(p[1])), (0, 17, t(p[0][17:])), (2, 0, t(p[2]))]),
        # A decode row beside a prompt's first chunk, then the chunk's rest beside another.
        engine.run_packed([(2, 9, t([5])), (3, 0, t(p[1][:41]))]),
        engine.run_packed([(3, 41, t(p[1][41:])), (0, 150, t([7]))]),
    ]
    # Slot 1's state (its 70 positions) snapshotted and restored into slot 3; both go on alike.
    engine.slots.snapshot(1, 0, 70)
    engine.slots.begin(3)
    engine.slots.restore(3, 0)
    out.append(engine.run_packed([(3, 70, t([1, 2, 3, 4])), (1, 70, t([1, 2, 3, 4]))]))
    return [x.float().cpu() for x in out]


def test_the_devices_gdn_kernel_carries_each_slots_state_through_the_passes(monkeypatch):
    device = _engine(monkeypatch, "cuda", torch.bfloat16, None)
    assert device.model.gdn_kernel.name == ("fla" if fla_installed() else "chunk"), device.model.gdn_kernel.describe()
    mine = _passes(device)
    torch_form = _passes(_engine(monkeypatch, "cuda", torch.bfloat16, "chunk"))
    truth = _passes(_engine(monkeypatch, "cpu", torch.float32, "chunk"))
    for i, (m, t, want) in enumerate(zip(mine, torch_form, truth)):
        err = lambda x: ((x - want).abs().max() / want.abs().max()).item()  # noqa: E731
        assert err(m) <= 2 * err(t) + 1e-2, (i, err(m), err(t))
    # The restored slot and its source, fed alike: the same logits.
    assert torch.equal(mine[3][0], mine[3][1])

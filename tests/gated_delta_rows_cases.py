"""Inputs for the gated delta rule's decode step on the stacked state (the Triton kernel
pocketllm/ops/device/kernels/gated_delta_rows.py and its torch form
ops/gated_delta/indexed.gated_delta_rows_indexed_torch_), shared by the interpreter tests
(interpreted_gated_delta_rows.py), the CPU tests (test_gated_delta_rows_indexed.py) and the CUDA
tests (device/test_gated_delta_rows_on_cuda.py): a layer's q, k, v, g, beta for B sequences, made
as the views it hands over (q and k halves of one tensor, v a column slice of a wider row), a
stacked state of more slots than rows and the rows' slots out of order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from numerics import rel_err

# The torch form's sums (batched matmuls) and the kernel's run in different orders, and where
# they cancel an element's own ulps mean nothing: the outputs and the state are held to 8 ulps of
# their largest value.
FP32_REL = 8 * 2.0**-23

# (B, Hk, Hv, Dk, Dv, slots of the stacked state, the rows' slots)
SMALL = [
    (1, 2, 6, 16, 24, 4, [2]),
    (3, 2, 6, 16, 24, 5, [3, 0, 4]),
    # Neither head dim a power of two; two value blocks of the kernel's 32 columns, one partial.
    (3, 2, 6, 12, 40, 4, [1, 3, 0]),
]
# The model's head dims (three value heads per key head, as the 27B's 48 / 16).
MODEL = (2, 1, 3, 128, 128, 3, [2, 0])


def case_id(case) -> str:
    b, hk, hv, dk, dv, s, slots = case
    return f"B{b}-Hk{hk}-Hv{hv}-Dk{dk}-Dv{dv}-S{s}"


def rows_inputs(b, hk, hv, dk, dv, count, slots, dtype=torch.float32, device="cpu", seed=0):
    """(q, k, v, g, beta, state, slots) on `device`, drawn on the CPU (the same values on every
    device): q, k fp32 unit rows (q scaled by dk**-0.5), v in `dtype`, g <= 0 and beta in (0, 1)
    fp32, state [count, hv, dk, dv] fp32, slots [b] long."""
    gen = torch.Generator().manual_seed(seed)
    qk = F.normalize(torch.randn(b, 2 * hk, dk, generator=gen), dim=-1)
    q, k = qk[:, :hk] * dk**-0.5, qk[:, hk:]
    v = torch.randn(b, hv * dv + 5, generator=gen).to(dtype)[:, 3 : 3 + hv * dv].view(b, hv, dv)
    g, beta = -torch.rand(b, hv, generator=gen) * 2, torch.rand(b, hv, generator=gen)
    state = torch.randn(count, hv, dk, dv, generator=gen) * 0.3
    slots = torch.tensor(slots, dtype=torch.long)
    return tuple(t.to(device) for t in (q, k, v, g, beta, state, slots))


def assert_close(mine: torch.Tensor, theirs: torch.Tensor, rel: float = FP32_REL) -> None:
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype == torch.float32, (mine.shape, theirs.shape, mine.dtype)
    assert rel_err(mine, theirs) <= rel, f"{rel_err(mine, theirs) / 2.0**-23:.1f} ulps of the largest value from the torch form"


def untouched(state: torch.Tensor, before: torch.Tensor, slots) -> list[int]:
    """The slots not among `slots`, each asserted equal bit for bit to its row in `before`."""
    rest = [s for s in range(state.shape[0]) if s not in set(int(x) for x in slots)]
    for s in rest:
        assert torch.equal(state[s], before[s]), f"slot {s} is not in the batch and was changed"
    return rest

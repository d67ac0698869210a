"""The decode attention kernel (pocketllm/ops/device/kernels/decode_attention.py) compiled, on CUDA,
at the engine's shapes (blocks of 64 positions, the 27B's 24 query heads over 4 KV heads of 256,
rows thousands of positions long): against its torch form run on the CPU from the same values,
with NaN at every position no row holds (it reads only what a row holds), and captured in a CUDA
graph, replayed at other positions (its loop bound is read from memory). tests/test_device_ops.py
runs it under Triton's interpreter on CPU; tests/device/test_device_ops_on_cuda.py runs its case
among the other ops'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from device_caps import captured, cuda_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from device_op_cases import only_what_rows_hold  # noqa: E402
from numerics import rel_err  # noqa: E402
from pocketllm.ops.device import CUSTOM_OPS  # noqa: E402
from pocketllm.ops.paged_kv import decode_attention_rows_torch  # noqa: E402

pytestmark = pytest.mark.skipif(cuda_count() < 1, reason="needs 1 cuda device(s)")
B, HEADS, KV_HEADS, D, BLOCK, TABLE = 8, 24, 4, 256, 64, 70
POSITIONS = (0, 63, 64, 1000, 4095, 4096, 2047, 4479)


def _inputs(dtype, device):
    g = torch.Generator().manual_seed(30)
    blocks = B * TABLE + 5
    k_pool, v_pool = (torch.randn(blocks, KV_HEADS, BLOCK, D, generator=g).to(dtype).to(device) for _ in range(2))
    tables = torch.randperm(blocks, generator=g)[: B * TABLE].view(B, TABLE).to(torch.int32).to(device)
    q = torch.randn(B, HEADS, D, generator=g).to(dtype).to(device)
    return q, k_pool, v_pool, tables, torch.tensor(POSITIONS, device=device), D**-0.5


def _float64(q, k_pool, v_pool, tables, pos, scale) -> torch.Tensor:
    """The attention of each row over its positions 0..pos alone, in float64 on the CPU."""
    q, k_pool, v_pool, tables = (t.cpu() for t in (q, k_pool, v_pool, tables))
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, p in enumerate(pos.tolist()):
        at = torch.arange(p + 1)
        blocks = tables[r, at // BLOCK].long()
        keys, values = (pool[blocks, :, at % BLOCK].double().transpose(0, 1) for pool in (k_pool, v_pool))  # [Hkv, p + 1, D]
        scores = q[r].double().view(KV_HEADS, HEADS // KV_HEADS, D) @ keys.transpose(1, 2) * scale
        out[r] = (torch.softmax(scores, dim=-1) @ values).view(HEADS, D)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_kernel_reads_only_what_each_row_holds_at_the_engines_shapes(dtype):
    """Against float64: over thousands of positions the torch form's fp32 sums (in another order)
    land a bf16 output up to a few ulps from the truth where it is near zero, the kernel's too, so
    the comparison here is with the truth: one bf16 ulp of it, plus fp32 rounding."""
    args = _inputs(dtype, "cuda")
    q, k_pool, v_pool, tables, pos, scale = args
    mine = CUSTOM_OPS.decode_attention_rows(q, *only_what_rows_hold(k_pool, v_pool, tables, pos), tables, pos, scale).cpu()
    truth = _float64(*args)
    if dtype == torch.float32:
        assert rel_err(mine, truth) <= 1e-5
    else:
        err = (mine.double() - truth).abs()
        assert (err <= truth.abs() * 2**-8 + 1e-6 * truth.abs().max()).all(), f"{err.max():.2e}"
    theirs = decode_attention_rows_torch(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    assert rel_err(mine, theirs) <= (1e-5 if dtype == torch.float32 else 2**-8)


def test_rows_longer_than_the_devices_shares_at_the_engines_shapes():
    """Held to 3 shares (a device's are twice its SMs' programs, more than these rows need), every
    row past 768 positions is cut into 3 shares of more tiles: against float64 as above, and each
    row's bits those of a call of the row alone."""
    from pocketllm.ops.device.kernels import decode_attention

    args = _inputs(torch.bfloat16, "cuda")
    q, k_pool, v_pool, tables, pos, scale = args
    mine = decode_attention.decode_attention_rows(q, *only_what_rows_hold(k_pool, v_pool, tables, pos), tables, pos, scale, shares=3)
    truth = _float64(*args)
    err = (mine.cpu().double() - truth).abs()
    assert (err <= truth.abs() * 2**-8 + 1e-6 * truth.abs().max()).all(), f"{err.max():.2e}"
    for r in (0, 4, 7):
        alone = decode_attention.decode_attention_rows(q[r : r + 1], k_pool, v_pool, tables[r : r + 1], pos[r : r + 1], scale, shares=3)
        assert torch.equal(alone[0], mine[r])


def test_a_cuda_graph_replays_it_at_other_positions():
    """Captured once at some positions, replayed after the positions and q change in place: what
    the op gives eagerly at the new ones, bit for bit."""
    q, k_pool, v_pool, tables, pos, scale = _inputs(torch.bfloat16, "cuda")
    graph, out = captured(lambda: CUSTOM_OPS.decode_attention_rows(q, k_pool, v_pool, tables, pos, scale))
    pos.copy_(torch.tensor([4479, 1, 65, 0, 128, 3000, 4095, 64], device="cuda"))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, CUSTOM_OPS.decode_attention_rows(q, k_pool, v_pool, tables, pos, scale))


def test_a_cuda_graph_of_rows_longer_than_their_shares_replays_at_other_positions():
    """Held to 3 shares, captured where every row fits shares of 256 positions and replayed where
    most rows are cut into 3 longer shares (and the other way): the eager call's bits."""
    from pocketllm.ops.device.kernels import decode_attention

    q, k_pool, v_pool, tables, pos, scale = _inputs(torch.bfloat16, "cuda")
    launch = lambda: decode_attention.decode_attention_rows(q, k_pool, v_pool, tables, pos, scale, shares=3)  # noqa: E731
    pos.copy_(torch.tensor([0, 63, 64, 700, 767, 255, 256, 500], device="cuda"))
    graph, out = captured(launch)
    for positions in ([4479, 768, 769, 1000, 4095, 767, 2048, 3001], [0, 63, 64, 700, 767, 255, 256, 500]):
        pos.copy_(torch.tensor(positions, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, launch()), positions

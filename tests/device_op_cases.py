"""The device prefill ops' test cases, shared by the interpreter tests (interpreted_device_kernels.py),
the custom op tests (test_device_ops.py) and the CUDA tests (device/test_device_ops_on_cuda.py):
each op's inputs at a given dtype, rows and width on a given device, made as the strided views a
layer hands it (a column slice of a projection's output, heads of a wider row), its kernel, its
torch form, and how close the two must be."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from numerics import rel_err
from pocketllm.ops.device import torch_forms

# (rows, width) the comparisons run at: one row, a few, more than a conv block of rows (16);
# widths that are no power of two. The row-count tests take 67 rows.
ROW_SHAPES = [(1, 96), (3, 130), (7, 96)]
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most values of their dtype (bf16 or fp32) between an element of a and its match in b."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.numel() == 0:
        return 0
    bits, magnitude = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float32: (torch.int32, 0x7FFFFFFF)}[a.dtype]

    def ordered(t):
        # Sign and magnitude to one ordered integer line (+0 and -0 both 0).
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & magnitude), i)

    return int((ordered(a) - ordered(b)).abs().max())


def _randn(g, *shape, dtype, device, scale: float = 1.0) -> torch.Tensor:
    """Normal values drawn on the CPU (the same on every device), rounded to dtype, on device."""
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _wide(rows: int, width: int, dtype, device, g, offset: int = 3, extra: int = 7) -> torch.Tensor:
    """[rows, width] whose rows sit in a wider tensor: the column slice a projection's split gives."""
    return _randn(g, rows, width + extra, dtype=dtype, device=device)[:, offset : offset + width]


def conv_inputs(dtype, rows: int, width: int, device="cpu"):
    g = gen(10)
    x = _wide(rows, width, dtype, device, g)
    # The taps are the conv weight in the model's dtype, widened (exact).
    taps = _randn(g, 4, width, dtype=dtype, device=device, scale=0.5).float()
    state = _randn(g, 3, width, dtype=dtype, device=device)
    return x, taps, state


def conv_rows_inputs(dtype, rows: int, width: int, device="cpu"):
    """A decode step's conv: x [rows, width] (a column slice), taps [4, width], the layer's stacked
    windows of rows + 3 slots, the rows' slots out of order (three slots no row holds)."""
    g = gen(13)
    x = _wide(rows, width, dtype, device, g)
    taps = _randn(g, 4, width, dtype=dtype, device=device, scale=0.5).float()
    states = _randn(g, rows + 3, 3, width, dtype=dtype, device=device)
    slots = torch.randperm(rows + 3, generator=g)[:rows].to(device)
    return x, taps, states, slots


def kv_inputs(dtype, rows: int, width: int, device="cpu"):
    """Pools of 7 blocks of 16 positions, 2 heads; the sequence's blocks out of order, its rows
    from position 5 (block boundaries crossed, the rest of the pools left as they were)."""
    g = gen(11)
    blocks = -(-(rows + 5) // 16)
    k_pool, v_pool = (_randn(g, blocks + 2, 2, 16, width, dtype=dtype, device=device) for _ in range(2))
    table = torch.randperm(blocks + 2, generator=g).to(torch.int32).to(device)
    k = _randn(g, rows, 2, width, dtype=dtype, device=device)
    v = _randn(g, rows, 2, 2 * width, dtype=dtype, device=device)[..., width:]
    return k_pool, v_pool, table, 5, k, v


def kv_rows_inputs(dtype, rows: int, width: int, device="cpu"):
    """A decode step's rows: pools of blocks of 16 positions, 2 heads; each row's table 3 blocks
    of its own, out of order; its position cycling through 0, a block's last, the next block's
    first and further in (the rest of the pools left as they were)."""
    g = gen(13)
    k_pool, v_pool = (_randn(g, 3 * rows + 2, 2, 16, width, dtype=dtype, device=device) for _ in range(2))
    tables = torch.randperm(3 * rows + 2, generator=g)[: 3 * rows].view(rows, 3).to(torch.int32).to(device)
    pos = torch.tensor([(0, 15, 16, 40, 47)[r % 5] for r in range(rows)], device=device)
    k = _randn(g, rows, 2, width, dtype=dtype, device=device)
    v = _randn(g, rows, 2, 2 * width, dtype=dtype, device=device)[..., width:]
    return k_pool, v_pool, tables, pos, k, v


# Decode attention rows: 6 query heads over 2 KV heads, blocks of 16 positions, 6 blocks a table;
# a row's position cycles through 0, a block's last, the next block's first and several blocks in.
ATTN_HEADS, ATTN_KV_HEADS, ATTN_BLOCK, ATTN_TABLE = 6, 2, 16, 6
ATTN_POSITIONS = (0, 15, 16, 71, 95, 40)


def decode_attention_inputs(dtype, rows: int, width: int, device="cpu", block_size: int = ATTN_BLOCK,
                            capacity: int = ATTN_TABLE * ATTN_BLOCK):
    """q [rows, 6, D] (D = width, at most 256: a head's width; wider stands for the 27B's 256) at
    the cycled positions, over pools whose every table lists its blocks out of order, each table
    room for `capacity` positions."""
    g = gen(12)
    d = min(width, 256)
    m = -(-capacity // block_size)
    k_pool, v_pool = (_randn(g, rows * m + 3, ATTN_KV_HEADS, block_size, d, dtype=dtype, device=device) for _ in range(2))
    tables = torch.randperm(rows * m + 3, generator=g)[: rows * m].view(rows, m).to(torch.int32).to(device)
    pos = torch.tensor([ATTN_POSITIONS[r % len(ATTN_POSITIONS)] for r in range(rows)], device=device)
    q = _randn(g, rows, ATTN_HEADS, 2 * d, dtype=dtype, device=device)[..., :d]
    return q, k_pool, v_pool, tables, pos, d**-0.5


def only_what_rows_hold(k_pool, v_pool, tables, pos):
    """Copies of the pools with NaN at every position that no row's positions 0..pos cover: what
    a kernel that reads only those positions must not see."""
    block_size = k_pool.shape[2]
    held = torch.zeros(k_pool.shape[0], block_size, dtype=torch.bool, device=k_pool.device)
    for b, p in enumerate(pos.tolist()):
        at = torch.arange(p + 1, device=k_pool.device)
        held[tables[b, at // block_size].long(), at % block_size] = True
    held = held[:, None, :, None].expand(k_pool.shape)
    nan = torch.tensor(float("nan"), dtype=k_pool.dtype, device=k_pool.device)
    return tuple(torch.where(held, pool, nan) for pool in (k_pool, v_pool))


def _add_rms_norm(dtype, rows, width, device="cpu"):
    g = gen(1)
    h = _randn(g, rows, width, dtype=dtype, device=device)
    return h, _wide(rows, width, dtype, device, g), 1.0 + _randn(g, width, dtype=torch.float32, device=device, scale=0.1), EPS


def _rms_norm(dtype, rows, width, device="cpu"):
    # q of full attention: head rows of the query-and-gate projection.
    g = gen(2)
    q = _randn(g, rows, 2, 2 * width, dtype=dtype, device=device)[..., :width]
    return q, None, 1.0 + _randn(g, width, dtype=torch.float32, device=device, scale=0.1), EPS


def _rms_norm_gated(dtype, rows, width, device="cpu"):
    g = gen(3)
    x = _randn(g, rows, 2, width, dtype=dtype, device=device)
    z = _wide(rows, 2 * width, dtype, device, g).view(rows, 2, width)
    return x, z, 1.0 + _randn(g, width, dtype=dtype, device=device, scale=0.1), EPS


def _qk_l2_norm(dtype, rows, width, device="cpu"):
    g = gen(4)
    qk = _wide(rows, 4 * width, dtype, device, g, offset=0).view(rows, 4, width)
    return qk, 2, width**-0.5, EPS


def _gdn_gates(dtype, rows, width, device="cpu"):
    g = gen(5)
    heads = width // 16
    proj = _randn(g, rows, 2 * heads + 3, dtype=dtype, device=device, scale=3.0)
    neg_a = -torch.exp(torch.randn(heads, generator=g)).to(device)
    return proj[:, 3 + heads :], proj[:, 3 : 3 + heads], neg_a, _randn(g, heads, dtype=dtype, device=device)


def _silu_mul(dtype, rows, width, device="cpu"):
    gate_up = _randn(gen(6), rows, 2 * width, dtype=dtype, device=device, scale=2.0)
    return tuple(gate_up.chunk(2, dim=-1))


def _apply_rotary(dtype, rows, width, device="cpu"):
    g = gen(7)
    x = _randn(g, rows, 2, 2 * width, dtype=dtype, device=device)[..., width:]
    angles = (torch.rand(rows + 5, width // 4, generator=g) * 100).to(device)
    return x, angles.cos()[2 : 2 + rows], angles.sin()[2 : 2 + rows]


@dataclass(frozen=True)
class Case:
    name: str  # the torch form's name
    field: str  # the DeviceOps field that calls it
    op: str  # its custom op, torch.ops.pocketllm.OP
    make: Callable  # (dtype, rows, width, device="cpu") -> the call's arguments
    module: str  # the kernel's module under kernels/
    torch_form: Callable
    tol_ulps: dict  # output dtype -> the most ulps an output may be from the torch form's
    rows_of: tuple = ()  # arguments whose rows are the call's rows (each output row from its rows alone)
    # What to compare: the call's outputs, or the arguments it writes.
    outputs: Callable = field(default=lambda result, args: result if isinstance(result, tuple) else (result,))
    op_args: Callable = field(default=lambda args: args)  # the custom op's arguments
    # fp32 outputs that are sums whose terms cancel (the conv) are held to max error / max |ref|:
    # near a cancellation an ulp count says nothing.
    fp32_rel: float | None = None

    def check(self, mine: torch.Tensor, theirs: torch.Tensor, fp32_slack: int = 0) -> None:
        """Assert an output of the kernel is as close to the torch form's as this case allows
        (fp32_slack: ulps more for an fp32 output, for a device's approximate exp and log; a bf16
        output, rounded from fp32 values a few ulps apart, stays within its one ulp)."""
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype, (mine.shape, theirs.shape, mine.dtype, theirs.dtype)
        if self.fp32_rel is not None and mine.dtype == torch.float32:
            assert rel_err(mine, theirs) <= self.fp32_rel, f"{rel_err(mine, theirs):.2e} from the torch form"
            return
        tol = self.tol_ulps[mine.dtype]
        tol += fp32_slack if tol and mine.dtype == torch.float32 else 0
        worst = ulps(mine, theirs)
        assert worst <= tol, f"{worst} ulps from the torch form (at most {tol})"

    def kernel(self, kernels) -> Callable:
        """This case's launcher in the kernels package `kernels` (compiled or interpreted)."""
        module = getattr(kernels, self.module)
        return getattr(module, self.name.removesuffix("_torch"))


CASES = [
    Case("add_rms_norm_torch", "add_rms_norm", "add_rms_norm", _add_rms_norm, "add_rms_norm", torch_forms.add_rms_norm_torch,
         {torch.bfloat16: 1, torch.float32: 6}, rows_of=(0, 1)),
    Case("add_rms_norm_torch", "add_rms_norm", "rms_norm", _rms_norm, "add_rms_norm", torch_forms.add_rms_norm_torch,
         {torch.bfloat16: 1, torch.float32: 6}, rows_of=(0,), outputs=lambda result, args: result[1:],
         op_args=lambda args: (args[0], args[2], args[3])),
    Case("rms_norm_gated", "rms_norm_gated", "rms_norm_gated", _rms_norm_gated, "gated_norm", torch_forms.rms_norm_gated,
         {torch.bfloat16: 1, torch.float32: 8}, rows_of=(0, 1)),
    Case("qk_l2_norm_torch", "qk_l2_norm", "qk_l2_norm", _qk_l2_norm, "qk_l2_norm", torch_forms.qk_l2_norm_torch,
         {torch.float32: 6}, rows_of=(0,)),
    Case("gdn_gates_torch", "gdn_gates", "gdn_gates", _gdn_gates, "gdn_gates", torch_forms.gdn_gates_torch,
         {torch.float32: 6}, rows_of=(0, 1)),
    Case("silu_mul_torch", "silu_mul", "silu_mul", _silu_mul, "silu_mul", torch_forms.silu_mul_torch,
         {torch.bfloat16: 1, torch.float32: 4}, rows_of=(0, 1)),
    Case("causal_conv1d_prefill_", "causal_conv1d_prefill_", "causal_conv1d_prefill_", conv_inputs, "causal_conv",
         torch_forms.causal_conv1d_prefill_, {torch.bfloat16: 1, torch.float32: 0},
         outputs=lambda result, args: (result, args[2]), fp32_rel=1e-6),
    # Each row's window read and written at its slot: the windows compared whole (the slots no row
    # holds untouched).
    Case("causal_conv1d_rows_indexed_", "causal_conv1d_rows_indexed_", "causal_conv1d_rows_indexed_", conv_rows_inputs,
         "causal_conv_rows", torch_forms.causal_conv1d_rows_indexed_, {torch.bfloat16: 1, torch.float32: 0},
         outputs=lambda result, args: (result, args[2]), fp32_rel=1e-6),
    Case("apply_rotary_torch", "apply_rotary", "apply_rotary", _apply_rotary, "rope", torch_forms.apply_rotary_torch,
         {torch.bfloat16: 1, torch.float32: 1}, rows_of=(0, 1, 2)),
    Case("write_kv_torch", "write_kv", "write_kv", kv_inputs, "kv_write", torch_forms.write_kv_torch,
         {torch.bfloat16: 0, torch.float32: 0}, outputs=lambda result, args: (args[0], args[1])),
    Case("write_kv_rows_torch", "write_kv_rows", "write_kv_rows", kv_rows_inputs, "kv_write", torch_forms.write_kv_rows_torch,
         {torch.bfloat16: 0, torch.float32: 0}, outputs=lambda result, args: (args[0], args[1])),
    # An online softmax over tiles against one softmax over every position: fp32 sums in another order.
    Case("decode_attention_rows_torch", "decode_attention_rows", "decode_attention_rows", decode_attention_inputs,
         "decode_attention", torch_forms.decode_attention_rows_torch, {torch.bfloat16: 1}, rows_of=(0, 3, 4), fp32_rel=1e-5),
]
TOL_ULPS = {case.op: case.tol_ulps for case in CASES}

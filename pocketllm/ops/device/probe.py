"""Each device op run once on a tiny input on the device against its torch form on the same device,
before a run trusts the kernels (as the gated delta rule's device kernel is probed): a kernel that
does not compile or does not agree there leaves the torch forms, with the reason, rather than
failing a user's first pass."""

from __future__ import annotations

import torch

# The worst relative difference (max |diff| / max |torch form|) an op may show: the kernels round
# where the torch forms do, in fp32 with another summation order.
TOLERANCE = 1e-2
ROWS, WIDTH, HEADS, D = 5, 96, 4, 32


def _inputs(device, gen: torch.Generator) -> dict[str, tuple]:
    """Arguments of each op (DeviceOps field) at odd small shapes, bf16 where the layers pass bf16."""
    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    scale = 1 + 0.1 * randn(WIDTH, dtype=torch.float32)
    heads = randn(ROWS, HEADS, D)
    cos, sin = randn(ROWS, D // 4, dtype=torch.float32), randn(ROWS, D // 4, dtype=torch.float32)
    blocks, block_size = 3, 16
    pool = lambda: torch.zeros(blocks, 2, block_size, D, dtype=torch.bfloat16, device=device)  # noqa: E731
    table = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    return {
        "add_rms_norm": (randn(ROWS, WIDTH), randn(ROWS, WIDTH), scale, 1e-6),
        "rms_norm_gated": (heads, randn(ROWS, HEADS, D), randn(D), 1e-6),
        "qk_l2_norm": (randn(ROWS, 2 * HEADS, D), HEADS, D**-0.5, 1e-6),
        "gdn_gates": (randn(ROWS, HEADS), randn(ROWS, HEADS), -randn(HEADS, dtype=torch.float32).exp(), randn(HEADS)),
        "silu_mul": (randn(ROWS, WIDTH), randn(ROWS, WIDTH)),
        "causal_conv1d_prefill_": (randn(ROWS, WIDTH), randn(4, WIDTH, dtype=torch.float32), randn(3, WIDTH)),
        "causal_conv1d_rows_indexed_": (randn(ROWS, WIDTH), randn(4, WIDTH, dtype=torch.float32), randn(ROWS + 2, 3, WIDTH),
                                        torch.tensor([4, 0, 2, 5, 1], device=device)),
        "apply_rotary": (heads, cos, sin),
        "write_kv": (pool(), pool(), table, 14, randn(ROWS, 2, D), randn(ROWS, 2, D)),
        "write_kv_rows": (pool(), pool(), torch.stack((table, table.flip(0))), torch.tensor([17, 40], device=device), randn(2, 2, D),
                          randn(2, 2, D)),
        "decode_attention_rows": (randn(2, HEADS, D), randn(blocks, 2, block_size, D), randn(blocks, 2, block_size, D),
                                  torch.stack((table, table.flip(0))), torch.tensor([0, 40], device=device), D**-0.5),
    }


def _outputs(result, inputs: tuple) -> list[torch.Tensor]:
    """What an op gives: its returns, and the tensors it writes in place."""
    if result is None:  # the KV writes: their pools
        return [inputs[0], inputs[1]]
    outs = list(result) if isinstance(result, tuple) else [result]
    return [t for t in outs if isinstance(t, torch.Tensor)]


def disagreement(ops, reference, device) -> str | None:
    """Run every op of `ops` and of `reference` (DeviceOps) on `device` on the same inputs; None
    when each agrees, else which did not and why (its exception's first line, or how far off)."""
    for name, args in _inputs(device, torch.Generator().manual_seed(0)).items():
        clone = lambda: tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)  # noqa: E731
        mine_args, ref_args = clone(), clone()
        try:
            mine = _outputs(getattr(ops, name)(*mine_args), mine_args)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # the probe's purpose: any failure means "do not trust it"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"{name}: {type(exc).__name__}: {first}".rstrip(": ")
        ref = _outputs(getattr(reference, name)(*ref_args), ref_args)
        if name.startswith("causal_conv1d_"):
            mine, ref = mine + [mine_args[2]], ref + [ref_args[2]]  # the advanced state too
        for a, b in zip(mine, ref):
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
            if not err <= TOLERANCE:
                return f"{name} differs from its torch form by {err:.1e} of its largest value"
    return None

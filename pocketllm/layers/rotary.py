"""The rotary table: cos and sin per position for the partial NeoX rotation (ops/rotary.py rotates
the rows). Text-only positions make the checkpoint's mRoPE the plain 1-D rotation."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """cos/sin per position, computed once for a table of positions that the engine sizes to the
    sequence when it starts one (reserve). A decode step then slices one row instead of running
    arange, outer, cos and sin, about three times cheaper per step (docs/measuring.md, figures
    behind the code's choices)."""

    def __init__(self, rotary_dim: int, theta: float, device):
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
        empty = torch.empty(0, rotary_dim // 2, device=device)
        self._set(empty, empty)

    def _set(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._cos, self._sin = cos, sin
        # As plain ints for row_addresses, which a decode loop asks each step.
        self._rows, self._row_bytes = cos.shape[0], cos.stride(0) * cos.element_size()
        self._cos_at, self._sin_at = cos.data_ptr(), sin.data_ptr()

    def reserve(self, positions: int) -> None:
        """Make the table hold at least `positions` rows."""
        if positions > self._rows:
            self._set(*rotary_table(self.inv_freq, positions))

    def cos_sin(self, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows, rotary_dim/2] of positions start..start+rows, views of the table
        (grown to them if a caller did not reserve them)."""
        end = start + rows
        self.reserve(end)
        return self._cos[start:end], self._sin[start:end]

    def rows(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, rotary_dim/2] of positions pos [B] (long, within the reserved table):
        a gather a captured step can run, where cos_sin slices by a Python int."""
        return self._cos[pos], self._sin[pos]

    def row_addresses(self, pos: int) -> tuple[int, int]:
        """The addresses of position pos's cos and sin rows in the table (grown to it if need
        be): for compiled code fed a position without a torch op on the way."""
        self.reserve(pos + 1)
        return self._cos_at + pos * self._row_bytes, self._sin_at + pos * self._row_bytes


def rotary_table(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq for positions 0..positions-1, [positions, rd/2] in fp32."""
    pos = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(pos, inv_freq)
    return freqs.cos(), freqs.sin()

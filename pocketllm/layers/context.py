"""What every layer needs to know about the pass it is in (built by the model, for the engine's
passes; a leaf module, so layers and engine both import it and neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    start: int  # position of the first row
    slices: int  # the slice count the policy chose for these rows
    decode: bool
    cos: torch.Tensor  # [rows, rotary_dim/2]
    sin: torch.Tensor

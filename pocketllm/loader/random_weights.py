"""A preset's weights: seeded random tensors behind the same slice interface as a checkpoint, so a
preset runs the same loading path. Each tensor is a pure function of (seed, name, device): they are
generated on the device the engine runs on, where drawing them takes seconds where the host's
generator takes minutes for the big presets, and a device's generator draws other numbers than
the host's (a preset on CUDA is other random weights than on a CPU; each is the same run to run)."""

from __future__ import annotations

import zlib

import torch

from pocketllm.config import ModelConfig
from pocketllm.loader.model_tensors import model_tensors


def random_tensor(name: str, shape: tuple[int, ...], seed: int, device=None) -> torch.Tensor:
    """Values at the scale a trained checkpoint has, so activations stay in range (fp32, on
    `device`, default the host)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        return torch.empty(shape, device=device).uniform_(0.5, 1.5, generator=gen)
    # Scaled in place: a second fp32 copy of the 27B's vocabulary head would be 4.7 GiB on top.
    normal = torch.randn(shape, generator=gen, device=device)
    if name.endswith("linear_attn.norm.weight"):
        return normal.mul_(0.1).add_(1.0)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return normal.mul_(0.1)
    if name.endswith("conv1d.weight"):
        return normal.mul_(0.3)
    fan_in = shape[-1]
    return normal.mul_(0.5 / fan_in**0.5)


def random_row_blocks(name: str, shape: tuple[int, ...], seed: int, block_rows: int):
    """(first row, rows) blocks of random_tensor(name, shape, seed), the same values, generated a
    block at a time: a projection's normal draws come off one generator in row order, which gives
    the same numbers in blocks whose sizes are multiples of 16 as in one call (the tests check)."""
    cols = 1
    for d in shape[1:]:
        cols *= d
    plain = not any(name.endswith(s) for s in ("A_log", "dt_bias", "norm.weight", "layernorm.weight", "conv1d.weight"))
    if not plain or len(shape) != 2 or (block_rows * cols) % 16 or shape[0] <= block_rows:
        yield 0, random_tensor(name, shape, seed)
        return
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    scale = 0.5 / shape[-1] ** 0.5
    for r0 in range(0, shape[0], block_rows):
        yield r0, torch.randn(min(block_rows, shape[0] - r0), shape[1], generator=gen) * scale


class _RandomSlice:
    def __init__(self, name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device):
        self.name, self.shape, self.seed, self.dtype, self.device = name, shape, seed, dtype, device
        self._full: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        # A fused projection reads several row ranges of one slice: generate the tensor once. The
        # cast is elementwise, so casting only the rows read gives the same values.
        if self._full is None:
            self._full = random_tensor(self.name, self.shape, self.seed, self.device)
        return self._full[index].to(self.dtype)


# A preset's weights are the draws rounded to bf16, as a released checkpoint stores them, whatever
# dtype a run holds them in (an fp32 run of a preset differs from its bf16 run by arithmetic only);
# make-checkpoint writes these values at any --dtype.
PRESET_DTYPE = torch.bfloat16


class RandomWeights:
    def __init__(self, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = PRESET_DTYPE, device=None, tensors=None):
        """device: where the tensors are drawn (default the host): the engine's own. tensors: the
        model's (pocketllm.loader.model_tensors), where the model check has listed them already."""
        self.shapes = {t.key: t.shape for t in (tensors or model_tensors(cfg))}
        self.seed, self.dtype, self.device = seed, dtype, device

    def canonical_keys(self) -> set[str]:
        return set(self.shapes)

    def get_slice(self, name: str) -> _RandomSlice:
        return _RandomSlice(name, self.shapes[name], self.seed, self.dtype, self.device)

    def close(self) -> None:
        pass

"""Filling a model's parameters from a weight source (checked first by pocketllm/loader/checks.py)."""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from pocketllm.errors import CheckpointError
from pocketllm.loader.quantized import fill_quantized, for_device
from pocketllm.ops.quant.layout import QuantizedWeight


@torch.no_grad()
def load_weights(model: nn.Module, source, progress: bool = False) -> int:
    """Fill every parameter from its shard sources, one at a time (the host holds one tensor's
    part at a time on its way to the device, and at most one quantized weight); returns the bytes
    read into this rank. progress: a bar on stderr counting the weights' bytes, where stderr is a
    terminal."""
    loaded = 0
    params = list(model.named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in params) + sum(qw.nbytes for _, _, qw in _quantized(model))
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading", leave=False, dynamic_ncols=True, mininterval=1.0, disable=None if progress else True)
    for name, param in params:
        for src in param.sources:
            part = src.read(source.get_slice(src.key))
            dest = param.data if src.dest is None else param.data[src.dest[0] : src.dest[1]]
            if part.shape != dest.shape:
                raise CheckpointError(f"{src.key}: read {list(part.shape)} for {name}, which holds {list(dest.shape)}")
            dest.copy_(part)
            loaded += part.numel() * part.element_size()
        # Unmapping after every parameter keeps the file pages this rank touched from adding up
        # to a second copy of its weights; reopening a file costs only its header.
        source.close()
        bar.update(param.numel() * param.element_size())
    for module, name, qw in _quantized(model):
        size = qw.nbytes  # as the total counted it: filling may give the scales another dtype
        loaded += fill_quantized(qw, source)
        source.close()
        placed = for_device(qw, *qw.target)
        setattr(module, name, placed)
        if placed is not qw:
            # The kernels bound when the module was made hold the host weight (after_loading binds
            # the placed one's): dropped now, each host weight is freed once it is on the device,
            # so the host never holds more than one.
            module.kernels = None
        bar.update(size)
    bar.close()
    # Constants derived from the weights (fp32 norm scales, the GDN decay rate) are made once
    # here, not checked for on every forward.
    for module in model.modules():
        if hasattr(module, "after_loading"):
            module.after_loading()
    return loaded


def _quantized(model: nn.Module):
    """(module, attribute, weight) of each quantized weight the loader fills, one at a time: the
    walk holds no list of them, so one placed on a device can be freed from the host at once."""
    for module in model.modules():
        for name in [n for n, v in vars(module).items() if isinstance(v, QuantizedWeight) and hasattr(v, "sources")]:
            yield module, name, getattr(module, name)

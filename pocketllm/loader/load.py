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
    part at a time on its way to the device); returns the bytes read into this rank. progress: a
    bar on stderr counting the parameters' bytes, where stderr is a terminal."""
    loaded = 0
    params = list(model.named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in params)
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
    bar.close()
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, QuantizedWeight) and hasattr(value, "sources"):
                loaded += fill_quantized(value, source)
                source.close()
                setattr(module, name, for_device(value, *value.target))
    # Constants derived from the weights (fp32 norm scales, the GDN decay rate) are made once
    # here, not checked for on every forward.
    for module in model.modules():
        if hasattr(module, "after_loading"):
            module.after_loading()
    return loaded

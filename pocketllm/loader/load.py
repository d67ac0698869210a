"""Checking a weight source against the model's shape, and filling a model's parameters from it."""

from __future__ import annotations

import re

import torch
from torch import nn

from pocketllm.config import ModelConfig
from pocketllm.errors import CheckpointError
from pocketllm.loader.random_weights import expected_shapes

FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def validate_source(source, cfg: ModelConfig, max_listed: int = 5) -> None:
    """Missing keys, unexpected keys, shape and dtype mismatches, each named, before any weight is
    read. Layers beyond a `--layers` cut are not unexpected; a tied head's spare copy is ignored."""
    expected = expected_shapes(cfg)
    present = source.canonical_keys()

    def beyond_cut(key: str) -> bool:
        m = _LAYER.match(key)
        return bool(m) and int(m.group(1)) >= cfg.num_layers

    problems = []
    missing = sorted(set(expected) - present)
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listing(missing, max_listed)}")
    extra = sorted(k for k in present - set(expected) if not beyond_cut(k) and k != "lm_head.weight")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {_listing(extra, max_listed)}")
    for key in sorted(set(expected) & present):
        sl = source.get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != expected[key]:
            problems.append(f"{key} has shape {list(shape)}, expected {list(expected[key])}")
        dtype = sl.get_dtype()
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{key} has dtype {dtype}, expected a floating type")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems[:max_listed]))


def _listing(keys: list[str], n: int) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


@torch.no_grad()
def load_weights(model: nn.Module, source) -> int:
    """Fill every parameter from its shard sources; returns the bytes read into this rank."""
    loaded = 0
    for name, param in model.named_parameters():
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
    # Constants derived from the weights (fp32 norm scales, the GDN decay rate) are made once
    # here, not checked for on every forward.
    for module in model.modules():
        if hasattr(module, "after_loading"):
            module.after_loading()
    return loaded

"""Checking a weight source against the model's shape, and filling a model's parameters from it."""

from __future__ import annotations

import re

import torch
from torch import nn
from tqdm import tqdm

from pocketllm.config import ModelConfig
from pocketllm.errors import CheckpointError
from pocketllm.loader.compressed_tensors import expected_companions
from pocketllm.loader.fp8 import SCALE_SUFFIX
from pocketllm.loader.quantized import fill_quantized, for_device
from pocketllm.ops.quant.layout import QuantizedWeight

FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def expected_tensors(source, cfg: ModelConfig, tensors) -> dict[str, tuple[tuple[int, ...], set[str]]]:
    """Every tensor the checkpoint must hold, from the model's `tensors`
    (pocketllm.loader.model_tensors): name -> (shape, allowed safetensors dtypes). A weight stored
    packed (compressed-tensors) stands as its packed tensors, an fp8 one as its e4m3 values and
    block scales."""
    expected = {}
    plan, quant = cfg.weights, cfg.quantization
    for t in tensors:
        key, shape = t.key, t.shape
        if t.projection and plan is not None and plan.source == "compressed-tensors" and plan.scheme_for(key) is not None:
            expected.update(expected_companions(key, shape, plan.scheme_for(key)))
        elif t.projection and quant is not None and quant.method == "fp8" and source.has(key + SCALE_SUFFIX):
            br, bc = quant.block
            expected[key] = (shape, {"F8_E4M3"})
            expected[key + SCALE_SUFFIX] = ((-(-shape[0] // br), -(-shape[1] // bc)), {"F32", "BF16"})
        else:
            expected[key] = (shape, FLOAT_DTYPES)
    return expected


def validate_source(source, cfg: ModelConfig, tensors, max_listed: int = 5) -> None:
    """Missing keys, unexpected keys, shape and dtype mismatches, each named, before any weight is
    read; `tensors`: the model's (pocketllm.loader.model_tensors). Layers beyond a `--layers` cut
    are not unexpected; a tied head's spare copy is ignored."""
    expected = expected_tensors(source, cfg, tensors)
    full_shape = {t.key: t.shape for t in tensors}
    present = source.canonical_keys()

    def beyond_cut(key: str) -> bool:
        m = _LAYER.match(key)
        return bool(m) and int(m.group(1)) >= cfg.num_layers

    problems = []
    missing = sorted(set(expected) - present)
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listing(missing, max_listed)}")
    extra = sorted(k for k in present - set(expected) if not beyond_cut(k) and not k.startswith("lm_head.weight"))
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {_listing(extra, max_listed)}")
    for key in sorted(set(expected) & present):
        sl = source.raw_slice(key)
        shape, (want, dtypes) = tuple(sl.get_shape()), expected[key]
        if key.endswith("_zero_point") and sl.get_dtype() == "I8":
            # An older writer's unpacked zero points: one int8 per group.
            want, dtypes = (expected[key.removesuffix("_zero_point") + "_scale"][0], {"I8"})
        if shape != want:
            problems.append(f"{key} has shape {list(shape)}, expected {list(want)}")
        dtype = sl.get_dtype()
        if dtype not in dtypes:
            problems.append(f"{key} has dtype {dtype}, expected {' or '.join(sorted(dtypes))}")
        elif key.endswith("_shape") and (got := sl[:].tolist()) != list(full := full_shape[key.removesuffix("_shape")]):
            problems.append(f"{key} says {got}, expected {list(full)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems[:max_listed]))


def _listing(keys: list[str], n: int) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


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

"""Quantized projection weights at load: which weights a run holds quantized (the weight plan,
from --quantize and the checkpoint), whether the model can be split so at every rank, and each
rank's part of a whole matrix's quantization, read from the checkpoint's packed tensors or made
here from the float (or fp8) weights it reads.

A rank reads only its slice of the source tensor. A column-parallel shard holds whole rows and an
int4 row-parallel shard whole groups, so quantizing the slice gives exactly the slice of the
whole matrix's quantization. An int8 row-parallel shard's rows scale by the maximum over the whole
row: the ranks agree on it with one all-reduce (max) per weight at load."""

from __future__ import annotations

import torch

from pocketllm.config import ModelConfig
from pocketllm.distributed.state import all_reduce_max
from pocketllm.errors import CheckpointError, UsageError
from pocketllm.loader.compressed_tensors import check_host, read_packed
from pocketllm.loader.fp8 import SCALE_SUFFIX
from pocketllm.loader.model_tensors import projections
from pocketllm.ops.quant.layout import QuantizedWeight, dequantize, quantize
from pocketllm.quantization import WeightPlan, WeightScheme

# What an fp8 checkpoint becomes with no --quantize (docs/quantization.md says why).
FP8_DEFAULT = WeightScheme(8)
UNSET = "unset"


def plan_weights(cfg: ModelConfig, source, requested, tensors) -> WeightPlan | None:
    """The run's weight plan. `requested`: the --quantize scheme, None for `none`, UNSET when
    the flag was not given; `tensors`: the model's (pocketllm.loader.model_tensors). A float
    checkpoint (or preset) is quantized at load as asked; a compressed-tensors one runs as stored;
    an fp8 one is converted at load (FP8_DEFAULT unless asked otherwise, `none` for floats in the
    run's dtype)."""
    quant = cfg.quantization
    if quant is None:
        return None if requested in (UNSET, None) else WeightPlan(requested)
    keys = [t.key for t in projections(tensors)]
    if quant.method == "fp8":
        source.fp8_block = quant.block
        target = FP8_DEFAULT if requested == UNSET else requested
        stored = {k for k in keys if source.has(k + SCALE_SUFFIX)}
        return WeightPlan(None, "fp8", tuple((k, target if k in stored else None) for k in keys)) if target is not None and stored else None
    check_host()
    overrides = []
    for key in keys:
        if not source.has(key + "_packed"):
            overrides.append((key, None))
            continue
        names = (key.removesuffix(".weight"), source.to_file_key(key).removesuffix(".weight"))
        scheme = quant.scheme_for_module(names)
        if scheme is None:
            raise CheckpointError(f"{source.to_file_key(key)}_packed is stored packed, but no config group of quantization_config targets it")
        overrides.append((key, scheme))
    stored = sorted({s.name for _, s in overrides if s is not None})
    if requested != UNSET and (requested is None or requested.name not in stored or len(stored) > 1):
        raise UsageError(f"the checkpoint is stored quantized ({', '.join(stored)}); leave out --quantize, which only converts float and fp8 checkpoints")
    return WeightPlan(None, "compressed-tensors", tuple(overrides))


def check_split(tensors, plan: WeightPlan | None, world: int) -> None:
    """Every quantized weight's inputs must split into its groups, and at --tp-world a
    row-parallel shard must hold whole groups (and, packed, whole int32 words): one line naming
    the first of the model's `tensors` that does not, before any rank starts."""
    if plan is None:
        return
    for t in projections(tensors):
        key, cols, row_parallel = t.key, t.shape[1], t.row_parallel
        scheme = plan.scheme_for(key)
        if scheme is None:
            continue
        if scheme.bits == 4 and cols % scheme.group:
            raise UsageError(f"{scheme.name}: {key} has {cols} inputs, not a whole number of groups of {scheme.group}; use {_smaller(cols)}")
        local = cols // world
        if row_parallel and world > 1:
            if scheme.bits == 4 and local % scheme.group:
                fix = "fewer ranks (the checkpoint's groups are fixed)" if plan.source == "compressed-tensors" else f"{_smaller(local)} or fewer ranks"
                raise UsageError(
                    f"{scheme.name} at --tp-world {world}: each rank's shard of {key} holds {local} of its {cols} inputs, "
                    f"not whole groups of {scheme.group}; use {fix}"
                )
            if plan.source == "compressed-tensors" and local % (32 // scheme.bits):
                raise UsageError(f"{key} at --tp-world {world}: each rank's {local} inputs do not fall on whole packed int32 words; use fewer ranks")


def _smaller(n: int) -> str:
    fits = [f"int4-g{g}" for g in (32, 64, 128) if n % g == 0]
    return ", ".join(fits) if fits else "int8"


def read_quantized(source, key: str, full_shape: tuple[int, int], rows, cols, scheme: WeightScheme) -> QuantizedWeight:
    """This rank's part of weight `key` (rows `rows`, or columns `cols`) in `scheme`."""
    if getattr(source, "has", None) and source.has(key + "_packed"):
        return read_packed(source, key, scheme, rows, cols)
    sl = source.get_slice(key)
    row_max = None
    if rows is not None:
        parts = [sl[a:b] for a, b in rows if b > a]
        w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    else:
        w = sl[:, cols[0] : cols[1]]
        if scheme.bits == 8 and cols != (0, full_shape[1]):
            row_max = all_reduce_max(w.float().abs().amax(dim=1))
    scale_dtype = getattr(sl, "scale_dtype", None) or w.dtype
    return quantize(w, scheme.kind, scheme.group, scheme.symmetric, scale_dtype=scale_dtype, row_max=row_max)


def fill_quantized(qw: QuantizedWeight, source) -> int:
    """Fill an empty quantized weight (pocketllm.layers.sharding.quantized_param) from its
    sources; returns the bytes it holds."""
    for src in qw.sources:
        part = read_quantized(source, src.key, src.full_shape, src.rows, src.cols, qw.plan)
        d0, d1 = src.dest
        if part.qweight.shape != qw.qweight[d0:d1].shape or part.group != qw.group:
            raise CheckpointError(f"{src.key}: read {list(part.qweight.shape)} (group {part.group}), the weight holds {list(qw.qweight[d0:d1].shape)} (group {qw.group})")
        if qw.scales.dtype != part.scales.dtype:
            qw.scales = torch.zeros(qw.scales.shape, dtype=part.scales.dtype)
        if part.zeros is not None and qw.zeros is None:
            qw.zeros = torch.zeros(qw.scales.shape, dtype=torch.uint8)
        qw.qweight[d0:d1] = part.qweight
        qw.scales[d0:d1] = part.scales
        if part.zeros is not None:
            qw.zeros[d0:d1] = part.zeros
    return qw.nbytes


def for_device(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    """What a filled weight runs as on `device`: itself on a CPU, where the quantized kernels
    are; elsewhere its dequantized values in the run's dtype (the same numbers, not the bytes)."""
    if device.type == "cpu":
        return qw
    return dequantize(qw).to(dtype).to(device)

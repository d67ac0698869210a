"""The checks a weight source passes before any rank starts: the weight plan (which projections a
run holds quantized, from --quantize and the checkpoint), whether it splits at the run's TP
world, and the checkpoint's tensors against the model's names, shapes and dtypes. Torch-free:
the launcher runs them and never imports torch; loading is pocketllm/loader/load.py and
pocketllm/loader/quantized.py, on the ranks."""

from __future__ import annotations

import re

from pocketllm.config import ModelConfig
from pocketllm.errors import CheckpointError, UsageError
from pocketllm.loader.formats import SCALE_SUFFIX, check_host, expected_companions
from pocketllm.loader.model_tensors import projections
from pocketllm.quantization import WeightPlan, WeightScheme

# What an fp8 checkpoint becomes with no --quantize (docs/quantization.md says why).
FP8_DEFAULT = WeightScheme(8)
UNSET = "unset"


def plan_weights(cfg: ModelConfig, source, requested, tensors, device_kind: str = "cpu") -> WeightPlan | None:
    """The run's weight plan. `requested`: the --quantize scheme, None for `none`, UNSET when
    the flag was not given; `tensors`: the model's (pocketllm.loader.model_tensors). A float
    checkpoint (or preset) is quantized at load as asked; a compressed-tensors one runs as stored;
    an fp8 one is converted at load (unless asked otherwise: FP8_DEFAULT on a CPU; elsewhere
    floats in the run's dtype, `none`, since a device runs quantized weights dequantized and int8
    on the way would add its rounding to fp8's and save no memory)."""
    quant = cfg.quantization
    if quant is None:
        return None if requested in (UNSET, None) else WeightPlan(requested)
    keys = [t.key for t in projections(tensors)]
    if quant.method == "fp8":
        source.fp8_block = quant.block
        target = (FP8_DEFAULT if device_kind == "cpu" else None) if requested == UNSET else requested
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


def check_split(tensors, plan: WeightPlan | None, world: int, asked: str = "") -> None:
    """Every quantized weight's inputs must split into its groups, and at --tp-world a
    row-parallel shard must hold whole groups (and, packed, whole int32 words): one line naming
    the first of the model's `tensors` that does not, before any rank starts. asked: the flag and
    value that chose the scheme (`--quantize int4`), named with it; none for a checkpoint's own."""
    if plan is None:
        return

    def named(scheme) -> str:
        if not asked:
            return scheme.name
        return asked if asked.endswith(" " + scheme.name) else f"{asked} ({scheme.name})"

    for t in projections(tensors):
        key, cols, row_parallel = t.key, t.shape[1], t.row_parallel
        scheme = plan.scheme_for(key)
        if scheme is None:
            continue
        if scheme.bits == 4 and cols % scheme.group:
            raise UsageError(f"{named(scheme)}: {key} has {cols} inputs, not a whole number of groups of {scheme.group}; use {_smaller(cols)}")
        local = cols // world
        if row_parallel and world > 1:
            if scheme.bits == 4 and local % scheme.group:
                fix = "fewer ranks (the checkpoint's groups are fixed)" if plan.source == "compressed-tensors" else f"{_smaller(local)} or fewer ranks"
                raise UsageError(
                    f"{named(scheme)} at --tp-world {world}: each rank's shard of {key} holds {local} of its {cols} inputs, "
                    f"not whole groups of {scheme.group}; use {fix}"
                )
            if plan.source == "compressed-tensors" and local % (32 // scheme.bits):
                raise UsageError(f"{key} at --tp-world {world}: each rank's {local} inputs do not fall on whole packed int32 words; use fewer ranks")


def _smaller(n: int) -> str:
    fits = [f"int4-g{g}" for g in (32, 64, 128) if n % g == 0]
    return ", ".join(fits) if fits else "int8"


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


def validate_source(source, cfg: ModelConfig, tensors, max_listed: int = 5, cut_from: int | None = None) -> None:
    """Missing keys, unexpected keys, shape and dtype mismatches, each named, before any weight is
    read; `tensors`: the model's (pocketllm.loader.model_tensors). cut_from: the layers config.json
    declares, where `--layers` cut cfg to fewer: the layers between are not unexpected, those past
    it are (a config that declares fewer layers than the weights hold is wrong, not a cut); a tied
    head's spare copy is ignored."""
    cut_from = cfg.num_layers if cut_from is None else cut_from
    expected = expected_tensors(source, cfg, tensors)
    full_shape = {t.key: t.shape for t in tensors}
    present = source.canonical_keys()

    def beyond_cut(key: str) -> bool:
        m = _LAYER.match(key)
        return bool(m) and cfg.num_layers <= int(m.group(1)) < cut_from

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
        if dtype == "F8_E4M3" and dtype not in dtypes and not source.has(key + SCALE_SUFFIX):
            # An fp8 weight is read with its block scales: without them it cannot be.
            problems.append(f"{key} is fp8 (F8_E4M3) without its scales: {key + SCALE_SUFFIX} is missing")
        elif dtype not in dtypes:
            problems.append(f"{key} has dtype {dtype}, expected {' or '.join(sorted(dtypes))}")
        elif key.endswith("_shape") and (got := sl[:].tolist()) != list(full := full_shape[key.removesuffix("_shape")]):
            problems.append(f"{key} says {got}, expected {list(full)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems[:max_listed]))


def _listing(keys: list[str], n: int) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")

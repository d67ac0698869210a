"""Which weights a run holds quantized, and how: the `--quantize` values, the quantization a
checkpoint's config.json declares (compressed-tensors' pack-quantized, Qwen's block FP8), and the
per-weight plan a model is built from. Plain data only: the layout itself is in
pocketllm.ops.quant.layout, reading and quantizing in pocketllm.loader."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pocketllm.errors import UsageError

INT4_GROUPS = (32, 64, 128)
# `int4` alone: groups of this many inputs (docs/quantization.md, accuracy against bytes).
DEFAULT_INT4_GROUP = 128
SCHEME_HELP = "none, int8, int4, int4-g32, int4-g64, int4-g128, each int4 also with -asym (e.g. int4-g64-asym)"


@dataclass(frozen=True)
class WeightScheme:
    """int8: symmetric, one scale per output row (group None). int4: groups of `group` inputs,
    symmetric or with a zero point per group."""

    bits: int
    group: int | None = None
    symmetric: bool = True

    @property
    def kind(self) -> str:
        """The layout's scheme name (pocketllm.ops.quant.layout)."""
        return f"int{self.bits}"

    @property
    def name(self) -> str:
        if self.bits == 8:
            return "int8"
        return f"int4-g{self.group}" + ("" if self.symmetric else "-asym")

    def bits_per_weight(self, scale_bytes: int = 2) -> float:
        """Bits stored per weight, scales and zero points included (rows of many groups)."""
        if self.bits == 8:
            return 8.0
        return 4 + (8 * scale_bytes + (0 if self.symmetric else 8)) / self.group


_SCHEME = re.compile(r"^int4(?:-g(\d+))?(-asym)?$")


def parse_scheme(text: str, flag: str = "--quantize", none: bool = True) -> WeightScheme | None:
    """A `--quantize` value -> its scheme; "none" -> None (where `none` is one). One-line usage
    error otherwise."""
    value = (text or "").strip().lower()
    if value == "none":
        return None
    if value == "int8":
        return WeightScheme(8)
    m = _SCHEME.match(value)
    if m:
        group = int(m.group(1)) if m.group(1) else DEFAULT_INT4_GROUP
        if group in INT4_GROUPS:
            return WeightScheme(4, group, symmetric=m.group(2) is None)
    raise UsageError(f"{flag} {text!r} is not a scheme: use {SCHEME_HELP if none else SCHEME_HELP.removeprefix('none, ')}")


@dataclass(frozen=True)
class CheckpointQuant:
    """The quantization a checkpoint's config.json declares.
    compressed-tensors: (targets, scheme) per config group and the ignore list, module names as
    the checkpoint spells them ("Linear" targets every linear layer, "re:" a regular expression).
    fp8: e4m3 weights with one fp32 `weight_scale_inv` per block of `block` (rows, columns); the
    modules named in `ignore` (modules_to_not_convert) are stored unquantized."""

    method: str  # "compressed-tensors" or "fp8"
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...] = ()
    ignore: tuple[str, ...] = ()
    block: tuple[int, int] = (128, 128)

    @property
    def label(self) -> str:
        if self.method == "fp8":
            return f"fp8 e4m3, {self.block[0]}x{self.block[1]} blocks"
        return "compressed-tensors " + ", ".join(sorted({s.name for _, s in self.groups}))

    def scheme_for_module(self, names: tuple[str, ...]) -> WeightScheme | None:
        """The scheme of the first config group targeting a linear module known by `names`, None
        when ignored or targeted by none (compressed-tensors only)."""
        if any(_matches(t, names) for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, names) for t in targets):
                return scheme
        return None


def _matches(target: str, names: tuple[str, ...]) -> bool:
    if target.startswith("re:"):
        return any(re.match(target[3:], n) for n in names)
    return target in names


def parse_quantization_config(raw, where: str) -> CheckpointQuant | None:
    """config.json's `quantization_config` -> what it declares; a config this engine cannot run
    is a one-line error naming what is supported."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: quantization_config is not an object")
    method = raw.get("quant_method")
    if method == "fp8":
        fmt = raw.get("fmt", "e4m3")
        block = raw.get("weight_block_size")
        if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise UsageError(f"{where}: fp8 quantization_config with fmt {fmt!r}, weight_block_size {block!r}: supported is e4m3 with [rows, cols] blocks")
        ignore = tuple(raw.get("modules_to_not_convert") or ())
        return CheckpointQuant("fp8", ignore=ignore, block=(block[0], block[1]))
    if method != "compressed-tensors":
        raise UsageError(f"{where}: quant_method {method!r} is not supported: pocketllm loads compressed-tensors (pack-quantized) and fp8 checkpoints")
    fmt = raw.get("format")
    if fmt != "pack-quantized":
        raise UsageError(f"{where}: compressed-tensors format {fmt!r} is not supported: pocketllm loads pack-quantized (int8/int4 weight-only)")
    groups = []
    for name, group in (raw.get("config_groups") or {}).items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise UsageError(f"{where}: config group {name!r} has no weights scheme")
        if group.get("input_activations") or group.get("output_activations"):
            raise UsageError(f"{where}: config group {name!r} quantizes activations; pocketllm runs weight-only schemes (int8/int4 weights, float activations)")
        groups.append((tuple(group.get("targets") or ()), _weights_scheme(group["weights"], f"{where}: config group {name!r}")))
    if not groups:
        raise UsageError(f"{where}: compressed-tensors quantization_config has no config_groups")
    return CheckpointQuant("compressed-tensors", tuple(groups), tuple(raw.get("ignore") or ()))


def _weights_scheme(w: dict, where: str) -> WeightScheme:
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    group, symmetric = w.get("group_size"), w.get("symmetric", True)
    if strategy is None:
        strategy = "channel" if group in (None, -1) else "group"
    supported = "int8 symmetric per channel, or int4 per group of 32, 64 or 128 (symmetric or not)"
    if kind != "int" or w.get("dynamic") or w.get("actorder") == "group":
        raise UsageError(f"{where}: weights {kind} dynamic={w.get('dynamic')} actorder={w.get('actorder')} are not supported: {supported}")
    if bits == 8 and strategy == "channel" and symmetric:
        return WeightScheme(8)
    if bits == 4 and strategy == "group" and group in INT4_GROUPS:
        return WeightScheme(4, group, bool(symmetric))
    raise UsageError(f"{where}: {bits}-bit {strategy} weights (group_size {group}, symmetric {symmetric}) are not supported: {supported}")


@dataclass(frozen=True)
class WeightPlan:
    """How one run holds each projection (and head) weight: `default` for every one not listed in
    `overrides` (key, scheme or None for unquantized), and where the values come from: "load"
    (quantized here from float weights), "compressed-tensors" or "fp8" (the checkpoint's)."""

    default: WeightScheme | None
    source: str = "load"
    overrides: tuple[tuple[str, WeightScheme | None], ...] = ()

    def scheme_for(self, key: str) -> WeightScheme | None:
        for k, scheme in self.overrides:
            if k == key:
                return scheme
        return self.default

    def formats(self) -> list[str]:
        """The quantized formats the run holds weights in, as the kernel registry names them."""
        return sorted({s.name for s in [self.default, *(s for _, s in self.overrides)] if s is not None})

    def describe(self) -> str:
        names = self.formats()
        kept = sum(1 for _, s in self.overrides if s is None)
        how = {"load": "quantized at load", "compressed-tensors": "as stored, compressed-tensors", "fp8": "converted from the fp8 checkpoint at load"}[self.source]
        return f"weights {', '.join(names) or 'unquantized'} ({how}" + (f"; {kept} kept unquantized" if kept else "") + ")"

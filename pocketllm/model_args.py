"""The flags every model command shares, and the run plan's model checked: the config, the weight
source, the dtype and the slice policy. Everything here runs before any rank starts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

from pocketllm import compiled
from pocketllm.config import ModelConfig, check_tp_split, load_config
from pocketllm.device_kind import DEVICE_HELP
from pocketllm.distributed.calibration import check_calibration
from pocketllm.distributed.policy import OVERLAP_POLICIES, CalibratedPolicy, PolicyChoice, resolve_policy
from pocketllm.errors import UsageError
from pocketllm.generation_config import merged_eos_ids, read_generation_config
from pocketllm.loader.checkpoint import CheckpointReader
from pocketllm.loader.model_tensors import ModelTensor, model_tensors
from pocketllm.loader.checks import UNSET, check_split, plan_weights, validate_source
from pocketllm.ops.gdn_choice import KernelChoice, plan_gdn_kernel
from pocketllm.out_file import is_special
from pocketllm.presets import DEFAULT_PRESET, PRESETS, get_preset
from pocketllm.quantization import SCHEME_HELP, parse_scheme
from pocketllm.run_plan import RunPlan
from pocketllm.switches import bf16_layout, forces_kernels

# --dtype's names and each one's bytes per element. The launcher checks a name and never imports
# torch; a rank (or a one-process command) takes the torch dtype (parse_dtype).
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Every flag a model command (generate, bench, profile) takes."""
    add_rank_args(p)
    add_source_args(p)
    add_overlap_args(p)
    add_profiling_args(p)


def add_rank_args(p: argparse.ArgumentParser, default_world: int = 1) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--device", default="auto", help=DEVICE_HELP)
    g.add_argument(
        "--tp-world", type=int, help=f"tensor-parallel ranks (default {default_world}, or torchrun's WORLD_SIZE); alone, starts them locally"
    )
    g.add_argument("--tp-rank", type=int, help="this process's rank when starting one process per rank by hand")
    # --nccl-id-path is the seed's name for the same file (every backend meets through it, not NCCL alone).
    g.add_argument(
        "--rendezvous-file",
        "--nccl-id-path",
        dest="rendezvous_file",
        help="rendezvous file shared by hand-started ranks; rank 0 creates it, one left by an earlier run is refused (alias --nccl-id-path)",
    )
    g.add_argument(
        "--collective", help="the TP all-reduce: auto (default: shm when every rank is a CPU rank on this host), shm or gloo (env POCKETLLM_COLLECTIVE)"
    )
    g.add_argument(
        "--cpus",
        metavar="LIST",
        help="the cores of the ranks --tp-world starts here: one cpulist per rank separated by '/' (0-3/4-7), or one list to share out "
        "(default: the cores this process may use, whole cores per rank on one NUMA node; env POCKETLLM_CPUS)",
    )
    g.add_argument("--dist-timeout", type=float, help="seconds a collective may wait before the run ends with an error (default 120 on gloo, 600 on NCCL/HCCL)")


def add_source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", help=f"embedded model with seeded random weights: {', '.join(PRESETS)} (default {DEFAULT_PRESET})")
    g.add_argument("--ckpt", help="HF checkpoint directory (config.json + safetensors)")
    g.add_argument("--layers", type=int, help="run the first N layers (a preset's stack, 3 linear to 1 full, grows or is cut to N: under 4 it has no full-attention layer)")
    g.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 (default) or float16; GDN state and norms stay fp32")
    g.add_argument(
        "--quantize",
        help=f"hold the projection and head weights quantized, weight-only: {SCHEME_HELP} (docs/quantization.md); "
        "a quantized checkpoint needs no flag, an fp8 one loads as int8 on a CPU (as floats on a GPU or NPU) unless told otherwise",
    )


def add_overlap_args(p: argparse.ArgumentParser, pin: bool = True, policy: bool = True) -> None:
    """The slice policy's flags. A command that times slice counts itself leaves out the pin, and
    one that names its policies itself leaves out --overlap-policy."""
    o = p.add_argument_group("collective overlap")
    o.add_argument("--comm-overlap-slices", help="the slice rule's ceiling (env POCKETLLM_COMM_OVERLAP_SLICES, alias QWEN_COMM_OVERLAP_SLICES, default 4; 0 or 1 disables slicing)")
    if pin:
        o.add_argument("--pin-slices", help="use exactly K slices at every site, whatever the rule says; 0 or 1 runs unsliced (env POCKETLLM_PIN_SLICES)")
    if policy:
        o.add_argument("--overlap-policy", choices=OVERLAP_POLICIES, help="rule (the default) or calibrated (the default when a calibration is given)")
    o.add_argument("--calibration", help="a `pocketllm calibrate` file for the calibrated policy (env POCKETLLM_CALIBRATION)")
    o.add_argument("--force-calibration", "--force", action="store_true", help="use a calibration made for another backend, world, hidden size or dtype")


def add_profiling_args(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("profiling (docs/profile.md)")
    f.add_argument("--phase-profile", action="store_true", help="device-synced phase profile, one report block per pass (env POCKETLLM_PHASE_PROFILE=1, or the seed's QWEN_PHASE_PROFILE=1)")
    f.add_argument("--host-profile", action="store_true", help="wall-clock spans on a CPU, no synchronisation; on a device its timing events, read after one synchronisation a pass (env POCKETLLM_HOST_PROFILE=1, or the seed's QWEN_HOST_PROFILE=1)")
    f.add_argument("--profile-out", metavar="DIR", help="also write every block as JSON lines, one file per rank, to DIR")
    f.add_argument("--trace-out", metavar="DIR", help="write a Chrome/Perfetto trace per rank to DIR (turns the host profile on)")
    f.add_argument("--split-skew", action="store_true", help="with the phase profile: wait for every rank before each all-reduce and charge that wait to tp_skew")


@dataclass
class ModelPlan:
    cfg: ModelConfig
    dtype_name: str  # --dtype, checked: the torch dtype is `dtype`, on a rank
    policy: PolicyChoice | None  # None for a plan made without one (calibrate)
    ckpt: str | None
    preset: str | None
    # The reader that validated the checkpoint, files unmapped: loading reuses its key map instead
    # of rebuilding it from the index and every shard header (it travels to the other ranks with
    # the plan). Loading still reopens a shard, and parses its header, for each parameter it reads.
    reader: CheckpointReader | None = None
    # The GDN kernel planned for the run's device and dtype; each rank still probes a device
    # kernel before trusting it, and reports what it runs.
    gdn_kernel: KernelChoice | None = None
    # The model's tensors, listed by the check's one walk down the layers.
    tensors: tuple[ModelTensor, ...] = ()

    @property
    def dtype(self):
        return parse_dtype(self.dtype_name)

    @property
    def itemsize(self) -> int:
        """Bytes per element of --dtype, without torch (the launcher's checks size buffers by it)."""
        return DTYPES[self.dtype_name]

    def open_source(self, device=None):
        """The weights to load: the checkpoint's reader, or the preset's drawn on `device` (the
        engine's; default the host)."""
        if self.reader is not None:
            return self.reader
        from pocketllm.loader.random_weights import RandomWeights

        return RandomWeights(self.cfg, seed=0, device=device, tensors=self.tensors)

    @property
    def model_name(self) -> str:
        return self.ckpt or f"preset:{self.preset}"


def check_dtype(name: str) -> str:
    """--dtype checked: the name, or a usage error."""
    if name not in DTYPES:
        raise UsageError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    return name


def parse_dtype(name: str):
    """--dtype as a torch dtype (imports torch: a rank's, or a one-process command's)."""
    import torch

    return getattr(torch, check_dtype(name))


def preset_config(name: str, layers: int | None) -> ModelConfig:
    """The preset's config, cut or extended to `layers` when given. Unlike a checkpoint's, a
    preset's stack may grow: its weights are generated, not read."""
    cfg = get_preset(name)
    return cfg if layers is None else cfg.with_layers(layers)


def model_plan(run: RunPlan, with_policy: bool = True) -> ModelPlan:
    """The checked plan of the run's model. Without a policy (calibrate, which times slice counts
    under none) the plan's policy is None."""
    source, world, kind = run.source, run.world.size, run.device.kind
    if world < 1:
        raise UsageError(f"--tp-world must be >= 1, got {world}")
    dtype = check_dtype(source.dtype)
    # A bad POCKETLLM_ISA is refused here, before any rank starts.
    compiled.isa()
    _check_forced([dtype], kind)
    gdn_kernel = plan_gdn_kernel(kind, dtype)
    policy = None
    if with_policy:
        s = run.slices
        policy = resolve_policy(s.pin, s.ceiling, overlap_policy=s.overlap_policy, calibration=s.calibration)
    if source.ckpt is not None and source.preset is not None:
        raise UsageError("give either --ckpt or --preset, not both")
    for flag, value, what in (("--ckpt", source.ckpt, "checkpoint directory"), ("--preset", source.preset, "preset name")):
        if value == "":
            raise UsageError(f"{flag} is empty: give a {what}")
    requested = UNSET if source.quantize is None else parse_scheme(source.quantize)
    reader, preset = None, None
    if source.ckpt is not None:
        # The index and each shard's header, read once: validation below and loading reuse them.
        reader = CheckpointReader(source.ckpt)
        cfg, declared = checkpoint_config(source.ckpt, source.layers, source.layers_flag)
    else:
        preset = source.preset or DEFAULT_PRESET
        cfg = preset_config(preset, source.layers)
    # The one walk down the layers: the weight plan, the split check and validation read its list.
    tensors = model_tensors(cfg)
    cfg = dataclasses.replace(cfg, weights=plan_weights(cfg, reader, requested, tensors, kind))
    check_tp_split(cfg, world)
    check_split(tensors, cfg.weights, world, "" if requested is UNSET else f"--quantize {source.quantize}")
    _check_forced_quantized(cfg, kind)
    if reader is not None:
        validate_source(reader, cfg, tensors, cut_from=declared)
        reader.close()
    return ModelPlan(cfg, dtype, _checked_policy(policy, run, cfg), source.ckpt, preset, reader, gdn_kernel, tensors)


def checkpoint_config(ckpt: str, layers: int | None, flag: str = "--layers") -> tuple[ModelConfig, int]:
    """The checkpoint's config, cut to `layers` when given (a checkpoint's stack cannot grow), and
    the layers config.json declares. Its eos ids are config.json's and generation_config.json's."""
    cfg = load_config(ckpt)
    eos = merged_eos_ids(cfg.eos_token_ids, read_generation_config(ckpt, cfg.vocab_size))
    cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    if layers is None:
        return cfg, cfg.num_layers
    if layers > cfg.num_layers:
        raise UsageError(f"{flag} {layers}: the checkpoint has only {cfg.num_layers} layers")
    return cfg.with_layers(layers), cfg.num_layers


def _check_forced(formats, kind: str, env=os.environ) -> None:
    """The kernels POCKETLLM_KERNELS forces, checked against the weights' formats on this kind of
    device (pocketllm.ops.registry.check_forced), and POCKETLLM_BF16_LAYOUT's value. The registry holds the kernels themselves, so
    it is imported only when a variable that check reads is set: a launcher otherwise never
    imports torch."""
    bf16_layout(env)
    if forces_kernels(env):
        from pocketllm.ops import registry

        registry.check_forced(formats, kind, env)


def _check_forced_quantized(cfg: ModelConfig, kind: str) -> None:
    # Off the CPU quantized weights run dequantized, as floats: only a CPU run holds them.
    if cfg.weights is not None and kind == "cpu":
        _check_forced(cfg.weights.formats(), kind)


def _checked_policy(policy: PolicyChoice | None, run: RunPlan, cfg: ModelConfig) -> PolicyChoice | None:
    return None if policy is None else checked_for_run(policy, run, cfg.hidden_size)


def checked_for_run(choice: PolicyChoice, run: RunPlan, hidden: int) -> PolicyChoice:
    """The plan's policy, with a calibrated one checked against the run it would drive: the
    backend the device resolved to, the world, the model's hidden size and the dtype."""
    policy = choice.policy
    if not isinstance(policy, CalibratedPolicy):
        return choice
    if run.world.size == 1:
        # One rank slices nothing, so no calibration can be wrong for it (and none can be made
        # for it): an exported POCKETLLM_CALIBRATION must not stop single-rank runs.
        note = f"calibration {policy.source} unused: one rank has no all-reduce to overlap"
        return PolicyChoice(policy, "; ".join(n for n in (choice.note, note) if n))
    note = check_calibration(
        policy.calibration, policy.source, run.device.backend, run.world.size, hidden, run.source.dtype, run.slices.force_calibration
    )
    return PolicyChoice(policy, "; ".join(n for n in (choice.note, note) if n) or None)


def check_out_path(path: str | None, flag: str, ckpt: str | None = None) -> None:
    """An output file's directory must exist and the name must not be a directory, before any
    measuring, so a typo does not cost a run; and it must not lie in the checkpoint the run reads
    (a results file written over its config.json or a shard, say)."""
    if path is None:
        return
    if not path:
        raise UsageError(f"{flag} is empty: give the file to write")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path}: directory {directory} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give the file to write")
    if is_special(path):
        # /dev/null, /dev/stdout, a FIFO: written into (pocketllm.out_file), so it must take writes.
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: is not writable by this user")
        return
    # A regular file is written beside itself (through a link, beside its target) and renamed.
    directory = os.path.dirname(os.path.realpath(path))
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{flag} {path}: directory {directory} is not writable")
    if ckpt is not None and os.path.isdir(ckpt):
        inside = os.path.realpath(directory)
        if os.path.commonpath([inside, os.path.realpath(ckpt)]) == os.path.realpath(ckpt):
            raise UsageError(f"{flag} {path} is inside --ckpt {ckpt}, the checkpoint this run reads; write it elsewhere")


def say(*parts, rank0: bool = True) -> None:
    """Progress and notes go to stderr, results to stdout."""
    from pocketllm.distributed.state import tp

    if not rank0 or tp().rank == 0:
        print(*parts, file=sys.stderr, flush=True)

"""One run's settings, typed and resolved once: the command line (and the environment it reads) is
turned into a RunPlan at the edge (pocketllm/commands/settings.py), before any rank starts; below
the commands nothing reads an argparse namespace. The ranks the launcher starts receive the plan
itself, as JSON in the environment, instead of re-parsing the command line: every rank runs on the
settings the launcher checked. A torchrun or hand-started rank has no launcher and makes its own
plan from its own command line."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field

from pocketllm.errors import UsageError
from pocketllm.fault_injection import Fault
from pocketllm.profiling.options import ProfileOptions

# The plan the launcher gives each rank it starts, as RunPlan.to_json writes it.
ENV_PLAN = "POCKETLLM_LAUNCH_PLAN"
# The collective backend of each device kind.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DEFAULT_DIST_TIMEOUT = {"gloo": 120.0, "nccl": 600.0, "hccl": 600.0}


@dataclass(frozen=True)
class DevicePlan:
    requested: str  # --device as given: auto, cpu, cuda, npu or an index
    kind: str  # what it resolved to, once: cpu, cuda or npu
    index: int | None = None  # the device --device N names, else None (each rank takes its local rank's)

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]


@dataclass(frozen=True)
class WorldPlan:
    size: int  # the ranks of the run: --tp-world, torchrun's WORLD_SIZE, or the command's default
    rank: int | None = None  # --tp-rank, for a hand-started rank
    rendezvous_file: str | None = None
    cpus: str | None = None  # --cpus, for the ranks the launcher starts
    dist_timeout: float | None = None  # None: the backend's default
    collective: str = "auto"  # the TP all-reduce asked for: auto, shm or gloo
    collective_asked: str = ""  # how: `--collective X`, `POCKETLLM_COLLECTIVE=X`, "" (the default)

    def timeout(self, backend: str) -> float:
        return self.dist_timeout if self.dist_timeout is not None else DEFAULT_DIST_TIMEOUT[backend]


@dataclass(frozen=True)
class SourcePlan:
    """Where the weights come from and how they are held."""

    preset: str | None = None
    ckpt: str | None = None
    layers: int | None = None
    dtype: str = "bfloat16"
    quantize: str | None = None  # a --quantize scheme, None when not given
    layers_flag: str = "--layers"  # the flag `layers` came from, to name it (bench's --smoke-layers)


@dataclass(frozen=True)
class SlicePlan:
    """The slice policy's flags; the environment's values are read where the policy is resolved."""

    ceiling: str | None = None  # --comm-overlap-slices
    pin: str | None = None  # --pin-slices
    overlap_policy: str | None = None
    calibration: str | None = None
    force_calibration: bool = False


@dataclass(frozen=True)
class RunPlan:
    command: str
    device: DevicePlan
    world: WorldPlan
    source: SourcePlan | None = None  # None: a model-free command (allreduce)
    slices: SlicePlan = field(default_factory=SlicePlan)
    profiling: ProfileOptions = field(default_factory=ProfileOptions)
    fault: Fault | None = None  # POCKETLLM_FAULT, for tests
    task: typing.Any = None  # the command's own settings, a frozen dataclass of its module

    @classmethod
    def one_rank(cls, source: SourcePlan, kind: str = "cpu") -> RunPlan:
        """One rank on a device of `kind` under the default slice policy: what a script that builds
        an engine in its own process (the benchmarks) plans its model with."""
        return cls("", DevicePlan(kind, kind), WorldPlan(1), source)

    def to_json(self) -> str:
        return json.dumps(_encode(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, task_type: type | None = None) -> RunPlan:
        doc = json.loads(text)
        task = doc.pop("task", None)
        plan = _decode(cls, doc)
        return dataclasses.replace(plan, task=None if task is None or task_type is None else _decode(task_type, task))


def received(env) -> tuple[str, str] | None:
    """(the command, the plan's JSON) the launcher gave this rank, or None when it was given none."""
    text = env.get(ENV_PLAN)
    if not text:
        return None
    try:
        return json.loads(text)["command"], text
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{ENV_PLAN} is not a plan the launcher wrote; it is set only by pocketllm's launcher") from None


def _encode(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(kind, value):
    """`value` (from JSON) as an instance of the annotated type `kind`: dataclasses, tuples,
    optionals and plain values."""
    if value is None:
        return None
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        return _decode(options[0], value) if len(options) == 1 else value
    if origin is tuple:
        item = typing.get_args(kind)[0]
        return tuple(_decode(item, v) for v in value)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(**{name: _decode(hints[name], v) for name, v in value.items()})
    return value

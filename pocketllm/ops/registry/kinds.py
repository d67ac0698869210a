"""What the registry knows about a kernel: a candidate (a function and what it can run), a kind (the
candidates for one weight format family and one row class, with its preference order), the row
classes a projection's call falls in, a weight's format, and POCKETLLM_KERNELS, the one variable
that forces kernels: kind=name,... (one-row=c-ahead,int8-one-row=c)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pocketllm.errors import UsageError
from pocketllm.ops.gemv.panels import PanelWeight
from pocketllm.ops.quant.layout import QuantizedWeight
from pocketllm.switches import ENV_INVARIANT, ENV_KERNELS, env_switch, env_value, refuse_renamed

# kernel(x, prepared weight, out) -> None, writing into out: one row x [in] -> out [out], several
# rows x [m, in] -> out [m, out].
Kernel = Callable[[object, object, torch.Tensor], None]

ONE, FEW, MANY = "one-row", "few-row", "many-row"
# A pass of more rows than this never takes a few-row kernel (the engine reserves at most this many
# slots' worth of few-row choices; calibrate asks for no more).
FEW_MAX = 16


# ENV_INVARIANT, on (the default): a request's tokens do not depend on what else is batched with
# it. Every row of a one-row or few-row call is summed as the one-row kernel sums it alone (only
# candidates that do so are chosen), and the engine runs each prompt chunk's rows in calls of
# their own (docs/batching.md). Off: faster candidates whose rows depend on the other rows of the
# call. ENV_KERNELS: kind=name,..., the kernel each named kind runs instead of the measured choice
# (forced_kernels). Both named in pocketllm.switches, which the launcher reads without torch.


def batch_invariant(env=os.environ, device_type: str = "cpu") -> bool:
    """Whether this run keeps each request's tokens independent of the others batched with it: by
    default on a CPU, only where asked on a device (whose batch-invariant shape, layers/context.py,
    is not yet priced on one: the shape a device runs by default promises no invariance)."""
    return env_switch(env, ENV_INVARIANT, default=device_type == "cpu")


def row_class(rows: int) -> str:
    """Which class of kernel a projection call of `rows` rows runs: the one place that decides
    what a decode row is (a pass of one row, whatever its position) for every layer."""
    if rows == 1:
        return ONE
    return FEW if rows <= FEW_MAX else MANY


def one_row(rows: int) -> bool:
    """Whether a pass of `rows` rows is one decode row: its mixers and norms take their one-row
    (compiled) forms."""
    return row_class(rows) == ONE


def few_rows_for(count: int) -> list[int]:
    """The row counts a few-row choice is made for, to run steps of up to `count` rows: every
    power of two from 2 up to the first at or above count (a pass of r rows runs the choice made
    for the next power of two up)."""
    out, rows = [], 2
    while rows // 2 < min(count, FEW_MAX):
        out.append(rows)
        rows *= 2
    return out


def weight_format(w) -> str:
    """A weight's format, as kinds, candidates and cache keys name it: the dtype of a plain tensor
    ("bfloat16", "float16", "float32"), "bfloat16-panels" (a PanelWeight), "int8", or
    "int4-g<group>" (with "-asym" for zero points)."""
    if isinstance(w, PanelWeight):
        return PANELS
    if isinstance(w, QuantizedWeight):
        if w.scheme == "int8":
            return "int8"
        return f"int4-g{w.group}" + ("" if w.symmetric else "-asym")
    return dtype_format(w.dtype)


def dtype_format(dtype: torch.dtype) -> str:
    """The format of a plain weight of `dtype`."""
    return str(dtype).removeprefix("torch.")


# A bf16 weight held in panels (ops.gemv.panels): a format, and a family, of its own.
PANELS = "bfloat16-panels"


def format_family(fmt: str) -> str:
    """The family a kind is declared for: "float" for every plain tensor, "panels" for a weight in
    panels, else the scheme."""
    if fmt == PANELS:
        return "panels"
    if fmt.startswith("int4"):
        return "int4"
    return "int8" if fmt == "int8" else "float"


def weight_bytes(w) -> int:
    """Bytes one product streams from the weight."""
    if isinstance(w, (QuantizedWeight, PanelWeight)):
        return w.nbytes
    return w.numel() * w.element_size()


def activation_dtype(w) -> torch.dtype:
    """The dtype of the rows a weight multiplies: a float weight's own (a PanelWeight's bf16), a
    quantized one's scales'."""
    return w.scales.dtype if isinstance(w, QuantizedWeight) else w.dtype


def weight_rows(w, r0: int, r1: int):
    """Output rows r0:r1 of a weight (a probe cut from it)."""
    return w.rows(r0, r1) if isinstance(w, (QuantizedWeight, PanelWeight)) else w[r0:r1]


def weight_device(w) -> torch.device:
    return w.qweight.device if isinstance(w, QuantizedWeight) else w.device  # a PanelWeight has .device


def always(fmt: str, device: torch.device) -> str:
    return ""


@dataclass(frozen=True)
class Candidate:
    """One kernel a kind may choose. `prepare(weight) -> prepared` gives the layout the kernel
    runs on (None: the weight as loaded); candidates with the same `layout` share one prepared
    form. `unavailable(weight_format, device)` says why it cannot run there ("" when it can)."""

    name: str
    run: Kernel
    what: str
    unavailable: Callable[[str, torch.device], str] = always
    prepare: Callable[[object], object] | None = None
    layout: str = ""
    # Sources whose text a measured choice depends on (compiled kernels): part of the cache key.
    sources: tuple = ()
    # False: never timed (a plain torch form many times slower than the rest); it runs where it is
    # the kind's default or forced.
    measured: bool = True
    # True: its prepared form is a second copy of the weight's bytes in another layout, which a
    # bound projection never holds beside the loaded weight (KernelSet.bind).
    copies: bool = False
    # The order each output row's sum is taken in, named: candidates (of any row class) with the
    # same name give a row the same bits whatever other rows the call has and however many. ""
    # where a row's bits may depend on them (a library GEMM that blocks by the call's shape).
    row_order: str = ""
    # True: a one-row kernel that takes x [1, in] and out [1, out] as well as x [in] and out [out],
    # the same call: a bound projection passes a decode row's tensors as they are, no views made.
    takes_rows: bool = False


@dataclass(frozen=True)
class Kind:
    """The candidates for weights of one format family at one row class.

    probe "stream": each weight shape is timed on the model's own weights of that shape, in the
    order a step reads them (a choice per shape); "widest": one probe cut from the widest weight
    (a choice per format). `streams`: its best kernel reads a big weight at close to the
    machine's read rate, so a measurement far below that is implausible."""

    name: str  # what rank 0's line calls it: "one-row", "few-row", "many-row" (or a quantized kind's)
    family: str
    rows: str  # ONE, FEW or MANY
    candidates: tuple[Candidate, ...]
    default: str
    prefer: tuple[str, ...] = ()  # a wash goes to the first of these within WASH of the fastest
    probe: str = "stream"
    streams: bool = False
    # What the compiled candidates were built for (rank 0's line); None: the bf16 GEMV's.
    isa: Callable[[], str] | None = None
    by_name: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "by_name", {c.name: c for c in self.candidates})

    def available(self, fmt: str, device: torch.device) -> list[str]:
        return [c.name for c in self.candidates if not c.unavailable(fmt, device)]

    def timed(self, fmt: str, device: torch.device) -> list[str]:
        """The available candidates a measurement times."""
        return [n for n in self.available(fmt, device) if self.by_name[n].measured]
    def allowed(self, fmt: str, device: torch.device, invariant: bool) -> list[str]:
        """The timed candidates a choice may take. Batch-invariant, a one-row or few-row kind
        takes only those with a row order where it has any (a decode row in a batch must get the
        bits it gets alone; bind() runs a few-row call row by row where no few-row candidate sums
        in the one-row kernel's order); many-row calls are one prompt chunk's own (any kernel)."""
        names = self.timed(fmt, device)
        if not invariant or self.rows == MANY:
            return names
        return [n for n in names if self.by_name[n].row_order] or names

    @property
    def setting(self) -> str:
        """The kind's name in POCKETLLM_KERNELS: its row class, after its family for quantized
        weights ("one-row", "int8-one-row")."""
        return self.name if self.family == "float" else f"{self.family}-{self.name}"

    def forcing(self, name: str) -> str:
        """How a run forces `name` for this kind, as an error names it."""
        return f"{ENV_KERNELS}={self.setting}={name}"

    def forced(self, env=os.environ) -> str | None:
        """The kernel POCKETLLM_KERNELS forces for this kind, the whole variable checked: None for
        auto (not named, or named as auto)."""
        return forced_kernels(env).get(self.setting)


_KINDS: dict[tuple[str, str], Kind] = {}


def register(kind: Kind) -> Kind:
    """Make `kind` the one for its (family, row class)."""
    _KINDS[(kind.family, kind.rows)] = kind
    return kind


def kind_for(fmt: str, rows: str) -> Kind | None:
    """The kind that runs weights of `fmt` at a row class (None: none declared; a family without a
    few-row kind runs few rows with its many-row kind)."""
    return _KINDS.get((format_family(fmt), rows))


def all_kinds() -> list[Kind]:
    return list(_KINDS.values())


def forced_kernels(env=os.environ) -> dict[str, str]:
    """POCKETLLM_KERNELS read and checked: kind setting -> forced kernel name, auto left out. A
    variable of the old spelling (switches.RENAMED), an entry that is not kind=name, a kind or
    a kernel not declared, or a kind named twice is a one-line usage error."""
    refuse_renamed(env)
    kinds = {k.setting: k for k in all_kinds()}
    out: dict[str, str] = {}
    for entry in (e.strip() for e in env_value(env, ENV_KERNELS).split(",")):
        if not entry:
            continue
        setting, eq, name = (part.strip() for part in entry.partition("="))
        if not eq or not setting or not name:
            raise UsageError(f"{ENV_KERNELS}: {entry!r} is not kind=kernel: write, e.g., {ENV_KERNELS}=one-row=c-ahead,int8-one-row=c")
        kind = kinds.get(setting)
        if kind is None:
            raise UsageError(f"{ENV_KERNELS}: {setting!r} is not a kernel kind: use {', '.join(kinds)}")
        if setting in out:
            raise UsageError(f"{ENV_KERNELS} names {setting} twice: {out[setting]} and {name}")
        if name != "auto" and name not in kind.by_name:
            label = kind.name if kind.family == "float" else f"{kind.family} {kind.name}"
            article = "an" if label.startswith("int") else "a"
            raise UsageError(f"{ENV_KERNELS}: {setting}={name!r} is not {article} {label} kernel: use auto, {', '.join(kind.by_name)}")
        out[setting] = name
    return {setting: name for setting, name in out.items() if name != "auto"}


def _check_beside_one_row(kind: Kind, name: str, env) -> None:
    """Batch-invariant, a few-row kernel runs only beside a one-row kernel that sums a row as it
    does: a forced one whose order no measured one-row candidate has needs the one-row kind forced
    to a kernel of that order too (else it would be set aside at bind, silently)."""
    order = kind.by_name[name].row_order
    one = next((k for k in all_kinds() if k.family == kind.family and k.rows == ONE), None)
    if one is None:
        return
    forced = one.forced(env)
    if forced is not None:
        # A torch one-row kernel (no row order) runs a batch's rows one at a time anyway.
        if one.by_name[forced].row_order and one.by_name[forced].row_order != order:
            raise UsageError(f"{kind.forcing(name)} sums a row otherwise than {one.forcing(forced)}: batch-invariant, they cannot run together")
        return
    if not any(c.row_order == order for c in one.candidates if c.measured):
        same = [c.name for c in one.candidates if c.row_order == order]
        raise UsageError(
            f"{kind.forcing(name)}: batch-invariant, it runs only beside a one-row kernel that sums as it does: force "
            f"{one.setting}={same[0] if same else '...'} too, or set {ENV_INVARIANT}=0"
        )


def check_forced(formats, device_kind: str, env=os.environ) -> None:
    """Every forced kernel names a candidate, and one that cannot run weights of these formats on
    this device is a usage error, before any rank starts; so is a forced few-row kernel whose rows
    depend on the call's other rows while the run is batch-invariant."""
    device = torch.device(device_kind)
    invariant = batch_invariant(env)
    for kind in all_kinds():
        name = kind.forced(env)
        if name is None:
            continue
        if invariant and kind.rows == FEW and not kind.by_name[name].row_order:
            raise UsageError(
                f"{kind.forcing(name)}: its rows' sums depend on the other rows of the call, so a request's tokens would depend on "
                f"what is batched with it; set {ENV_INVARIANT}=0 to run it anyway"
            )
        if invariant and kind.rows == FEW:
            _check_beside_one_row(kind, name, env)
        for fmt in formats:
            if format_family(fmt) != kind.family:
                continue
            why = kind.by_name[name].unavailable(fmt, device)
            if why:
                raise UsageError(f"{kind.forcing(name)}: {why}")

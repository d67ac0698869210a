"""The device seam: which device a rank runs on, its collective backend, and how to wait for it.
Detected once; the CPU path always works, CUDA and Ascend (torch_npu) are used when present."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from pocketllm.errors import UsageError
from pocketllm.run_plan import BACKENDS
from pocketllm.switches import env_value
from pocketllm.topology import physical_cores

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
DEVICE_HELP = "auto (default), cpu, cuda, npu, or N: device N of the one auto finds (the seed's --device 0; on CPU only 0)"
# Set by the launcher for each rank it pinned: that its cores are its own (the rank reads them from
# its affinity; the value lists them as a cpulist, for anyone inspecting the process).
ENV_RANK_CPUS = "POCKETLLM_RANK_CPUS"
# 0 leaves the ranks the launcher starts unpinned (default 1, pinned).
ENV_PIN_CPUS = "POCKETLLM_PIN_CPUS"


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # cpu, cuda or npu
    index: int

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.index)

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)
        elif self.kind == "npu":
            torch.npu.synchronize(self.index)

    @property
    def timing_event(self):
        """A function recording a timing event on the current stream and returning it (its
        elapsed_time(other) is in ms), or None on CPU, where an op has finished when it returns."""
        if self.kind == "cpu":
            return None
        module = torch.cuda if self.kind == "cuda" else torch.npu

        def record():
            event = module.Event(enable_timing=True)
            event.record()
            return event

        return record

    def describe(self) -> str:
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.index)
        if self.kind == "npu":
            return f"Ascend NPU {self.index}"
        n = cpu_count()
        return f"CPU ({n} core{'s' if n != 1 else ''})"


def allowed_cpus() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def cpu_count() -> int:
    return len(allowed_cpus())


def parse_device(requested: str) -> tuple[str, int | None]:
    """--device as (the kind asked for, the device index or None). A bare N is the seed's form:
    device N of whichever kind auto finds."""
    text = str(requested).strip()
    if text.isdigit():
        return "auto", int(text)
    if text not in DEVICE_CHOICES:
        raise UsageError(f"--device {requested!r} is not one of {', '.join(DEVICE_CHOICES)} or a device index N")
    return text, None


def _device_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count()
    return torch.npu.device_count() if kind == "npu" else 1


def resolve_kind(requested: str) -> str:
    kind, index = parse_device(requested)
    if kind == "auto":
        if torch.cuda.is_available():
            kind = "cuda"
        else:
            kind = "npu" if npu_available() else "cpu"
    elif kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to torch")
    elif kind == "npu" and not npu_available():
        raise UsageError("--device npu: torch_npu is not installed or sees no NPU")
    if index is not None and index >= _device_count(kind):
        if kind == "cpu":
            raise UsageError(f"--device {index}: no CUDA or NPU device is visible, and the CPU is device 0 (give --device 0, cpu or auto)")
        raise UsageError(f"--device {index}: torch sees {_device_count(kind)} {kind} device(s), 0..{_device_count(kind) - 1}")
    return kind


def device_index(requested: str) -> int | None:
    """The index --device names, or None when it names a kind only."""
    return parse_device(requested)[1]


def setup_device(kind: str, index: int | None, local_rank: int, world: int) -> DeviceInfo:
    """Bind this rank to its device (of the run plan's resolved kind: device `index` when --device
    named one, else its local rank's); on CPU give it one torch thread per physical core it may
    run on: all of them when the launcher pinned it, else its share of them."""
    info = DeviceInfo(kind, (local_rank if index is None else index) if kind != "cpu" else 0)
    if kind == "cuda":
        torch.cuda.set_device(info.index)
    elif kind == "npu":
        torch.npu.set_device(info.index)
    elif env_value(os.environ, ENV_RANK_CPUS):
        # Pinned by the launcher: every core this rank may run on is its own.
        torch.set_num_threads(physical_cores(allowed_cpus()))
    else:
        torch.set_num_threads(max(1, physical_cores(allowed_cpus()) // world))
    return info

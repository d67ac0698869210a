"""The device seam: which device a rank runs on, its collective backend, and how to wait for it.
Detected once; the CPU path always works, CUDA and Ascend (torch_npu) are used when present."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from pocketllm.errors import UsageError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


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

    def describe(self) -> str:
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.index)
        if self.kind == "npu":
            return f"Ascend NPU {self.index}"
        return f"CPU ({cpu_count()} cores)"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_kind(requested: str) -> str:
    if requested not in DEVICE_CHOICES:
        raise UsageError(f"--device {requested!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if npu_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to torch")
    if requested == "npu" and not npu_available():
        raise UsageError("--device npu: torch_npu is not installed or sees no NPU")
    return requested


def setup_device(requested: str, local_rank: int, world: int) -> DeviceInfo:
    """Bind this rank to its device; on CPU give it its share of the cores."""
    kind = resolve_kind(requested)
    info = DeviceInfo(kind, local_rank if kind != "cpu" else 0)
    if kind == "cuda":
        torch.cuda.set_device(info.index)
    elif kind == "npu":
        torch.npu.set_device(info.index)
    else:
        torch.set_num_threads(max(1, cpu_count() // world))
    return info

"""Which kind of device a run's ranks use (--device resolved once, before any rank starts) and the
cores a process may run on. Torch-free where it can be: the launcher resolves --device and never
imports torch on a machine where torch could see no GPU (a CPU-only build, or a GPU build without
the driver it needs), so its ranks start that much sooner."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys

from pocketllm.errors import UsageError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
DEVICE_HELP = "auto (default), cpu, cuda, npu, cuda:N or npu:N, or N: device N of the one auto finds (the seed's --device 0; on CPU only 0)"
# Set by the launcher for each rank it pinned: that its cores are its own (the rank reads them from
# its affinity; the value lists them as a cpulist, for anyone inspecting the process).
ENV_RANK_CPUS = "POCKETLLM_RANK_CPUS"
# 0 leaves the ranks the launcher starts unpinned (default 1, pinned).
ENV_PIN_CPUS = "POCKETLLM_PIN_CPUS"


def _torch_gpu_builds() -> set[str] | None:
    """The GPU platforms the installed torch was built for ("cuda", "hip"; empty for a CPU-only
    build), read from its version file without importing it; None where the file cannot say."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            text = f.read()
    except OSError:
        return None
    built = {name: re.search(rf"^{name}(?::[^=]*)?=\s*(.+)$", text, re.M) for name in ("cuda", "hip")}
    if any(m is None for m in built.values()):
        return None
    return {name for name, m in built.items() if m.group(1).strip() != "None"}


def torch_has_gpu_build() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its version file without
    importing it; True when the file cannot say, so the caller asks torch itself."""
    builds = _torch_gpu_builds()
    return builds is None or bool(builds)


def _driver_present(build: str) -> bool:
    """Whether this machine has what a GPU build of torch needs to see any GPU: CUDA's driver
    library (libcuda.so.1, which the driver installs and no wheel carries; WSL's included), or
    ROCm's kernel driver node (/dev/kfd). True off Linux, where these are not the names."""
    if sys.platform != "linux":
        return True
    if build == "hip":
        return os.path.exists("/dev/kfd")
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def torch_may_see_a_gpu() -> bool:
    """Whether torch could see a GPU here, told without importing it: its build is for a GPU and
    the driver that build needs is on this machine; True when the build cannot be read. The CUDA
    build is what pip installs from PyPI on Linux by default, CPU-only machines included, where
    asking torch itself would cost every launcher a torch import before its ranks start."""
    builds = _torch_gpu_builds()
    return builds is None or any(_driver_present(build) for build in builds)


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where it could not see a GPU."""
    if not torch_may_see_a_gpu():
        return False
    import torch

    return torch.cuda.is_available()


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


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
    kind, colon, index = text.partition(":")
    if colon and kind in ("cuda", "npu") and index.isdigit():
        return kind, int(index)  # torch's spelling of device N of a kind
    if text not in DEVICE_CHOICES:
        raise UsageError(f"--device {requested!r} is not one of {', '.join(DEVICE_CHOICES)}, cuda:N, npu:N or a device index N")
    return text, None


def _device_count(kind: str) -> int:
    if kind == "cpu":
        return 1
    import torch

    if kind == "cuda":
        return torch.cuda.device_count()
    return torch.npu.device_count() if kind == "npu" else 1


def resolve_kind(requested: str) -> str:
    kind, index = parse_device(requested)
    if kind == "auto":
        if cuda_available():
            kind = "cuda"
        else:
            kind = "npu" if npu_available() else "cpu"
    elif kind == "cuda" and not cuda_available():
        if not torch_has_gpu_build():
            # Not a driver or CUDA_VISIBLE_DEVICES matter: this torch cannot see a GPU at all.
            raise UsageError("--device cuda: the installed torch is a CPU-only build; install a CUDA build of torch")
        if not torch_may_see_a_gpu():
            raise UsageError("--device cuda: this machine has no GPU driver for torch to use (CUDA's libcuda.so.1, ROCm's /dev/kfd)")
        raise UsageError("--device cuda: no CUDA device is visible to torch")
    elif kind == "npu" and not npu_available():
        raise UsageError("--device npu: torch_npu is not installed or sees no NPU")
    if index is not None and index >= _device_count(kind):
        if kind == "cpu":
            raise UsageError(f"--device {index}: no CUDA or NPU device is visible, and the CPU is device 0 (give --device 0, cpu or auto)")
        raise UsageError(f"--device {str(requested).strip()}: torch sees {_device_count(kind)} {kind} device(s), 0..{_device_count(kind) - 1}")
    return kind


def device_index(requested: str) -> int | None:
    """The index --device names, or None when it names a kind only."""
    return parse_device(requested)[1]

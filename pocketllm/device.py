"""The device seam: the device a rank runs on, its collective backend, and how to wait for it. The
kind is resolved once, before any rank starts (pocketllm/device_kind.py); the CPU path always
works, CUDA and Ascend (torch_npu) are used when present."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pocketllm.device_kind import ENV_RANK_CPUS, allowed_cpus, cpu_count
from pocketllm.errors import UsageError
from pocketllm.run_plan import BACKENDS
from pocketllm.switches import env_value
from pocketllm.topology import physical_cores


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


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, queued behind the device's work rather than waiting for it: on
    CUDA a copy from pageable memory first waits for everything the stream holds (a decode step's
    graph, a pass's kernels), so the host could not launch the next pass's kernels meanwhile;
    through pinned memory the copy is queued like a kernel (torch keeps the pinned block until the
    copy has run). Elsewhere `t.to(device)`."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    pinned = _pinned(t)
    return t.to(device) if pinned is None else pinned.to(device, non_blocking=True)


def copy_to_device_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (on a device) <- host tensor src, queued as to_device's copy is."""
    pinned = _pinned(src) if dst.device.type == "cuda" and src.device.type == "cpu" else None
    if pinned is None:
        dst.copy_(src)
    else:
        dst.copy_(pinned, non_blocking=True)


# Whether this process can pin host memory: a host that refuses (a sandbox's limit on locked
# memory, say) gets the waiting copies, which are correct, rather than a failed run.
_can_pin = True


def _pinned(t: torch.Tensor) -> torch.Tensor | None:
    global _can_pin
    if _can_pin:
        try:
            return t.pin_memory()
        except RuntimeError:
            _can_pin = False
    return None


def setup_device(kind: str, index: int | None, local_rank: int, world: int) -> DeviceInfo:
    """Bind this rank to its device (of the run plan's resolved kind: device `index` when --device
    named one, else its local rank's); on CPU give it one torch thread per physical core it may
    run on: all of them when the launcher pinned it, else its share of them."""
    info = DeviceInfo(kind, (local_rank if index is None else index) if kind != "cpu" else 0)
    if kind in ("cuda", "npu"):
        backend = getattr(torch, kind)
        # A --device index is held to the count when the run is planned (device_kind.resolve_kind);
        # a rank's local rank is known only here. torch's own word would be an "invalid device
        # ordinal" traceback from deep inside.
        if index is None and local_rank >= backend.device_count():
            raise UsageError(f"local rank {local_rank} of {world} would take {kind}:{local_rank}, but this host shows "
                             f"{backend.device_count()} {kind} device(s): run at most {backend.device_count()} ranks on it")
        backend.set_device(info.index)
    elif env_value(os.environ, ENV_RANK_CPUS):
        # Pinned by the launcher: every core this rank may run on is its own.
        torch.set_num_threads(physical_cores(allowed_cpus()))
    else:
        torch.set_num_threads(max(1, physical_cores(allowed_cpus()) // world))
    return info

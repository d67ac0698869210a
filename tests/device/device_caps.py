"""What accelerator this machine has, for the device tests: each test is parametrised over the
devices it can run on and skipped (and counted as skipped) on a machine without that device."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def npu_count() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.device_count() if torch.npu.is_available() else 0


def device_count(kind: str) -> int:
    return cuda_count() if kind == "cuda" else npu_count()


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def npu_op_present() -> bool:
    from pocketllm.ops.gdn_choice import npu_op_present as present

    return present()


def on_devices(min_count: int = 1):
    """Parametrise a test over 'cuda' and 'npu', each skipped where fewer than min_count exist."""
    return pytest.mark.parametrize(
        "kind",
        [
            pytest.param(kind, marks=pytest.mark.skipif(device_count(kind) < min_count, reason=f"needs {min_count} {kind} device(s)"))
            for kind in ("cuda", "npu")
        ],
    )


def synchronize(kind: str) -> None:
    (torch.cuda if kind == "cuda" else torch.npu).synchronize()


def captured(fn):
    """fn() run once on a side stream (its lazy setup, its compiles) and then captured as a CUDA
    graph: (the graph, what the captured call returned, which each replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out

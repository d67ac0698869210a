"""Device backends get gloo beside them for the host-side collectives (timing maxima, RSS)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pocketllm.distributed.rendezvous import backend_spec


def test_device_backends_carry_cpu_tensors_through_gloo():
    assert backend_spec("gloo") == "gloo"
    assert backend_spec("nccl") == "cpu:gloo,cuda:nccl"
    assert backend_spec("hccl") == "cpu:gloo,npu:hccl"


@pytest.mark.parametrize("cpu_entry", [False, True], ids=["device-only", "backend_spec"])
def test_a_group_bound_to_a_device_reduces_cpu_tensors_only_with_the_cpu_entry(cpu_entry, tmp_path):
    # Stand-in for NCCL on a CPU-only machine: backend_spec's own string with gloo in NCCL's place.
    # A backend bound to cuda alone refuses a CPU tensor, which is what the host-side reductions
    # hit; with the cpu entry backend_spec adds they work.
    spec = backend_spec("nccl").replace("nccl", "gloo")
    if not cpu_entry:
        spec = spec.split(",", 1)[1]
    assert spec == ("cpu:gloo,cuda:gloo" if cpu_entry else "cuda:gloo")
    dist.init_process_group(spec, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        t = torch.ones(2, dtype=torch.float64)
        if cpu_entry:
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0]
        else:
            with pytest.raises(RuntimeError):
                dist.all_reduce(t)
    finally:
        dist.destroy_process_group()

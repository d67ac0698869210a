"""Device backends get gloo beside them for the host-side collectives (timing maxima, RSS)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pocketllm.distributed.rendezvous import backend_spec


def test_device_backends_carry_cpu_tensors_through_gloo():
    assert backend_spec("gloo") == "gloo"
    assert backend_spec("nccl") == "cpu:gloo,cuda:nccl"
    assert backend_spec("hccl") == "cpu:gloo,npu:hccl"


def test_a_group_bound_to_a_device_reduces_cpu_tensors_only_with_the_cpu_entry(tmp_path):
    # Stand-in for NCCL on a CPU-only machine: a backend bound to cuda alone refuses a CPU tensor,
    # which is what the host-side reductions hit; with the cpu entry of backend_spec they work.
    for spec, works in (("cuda:gloo", False), ("cpu:gloo,cuda:gloo", True)):
        dist.init_process_group(spec, store=dist.FileStore(str(tmp_path / spec), 1), rank=0, world_size=1)
        try:
            t = torch.ones(2, dtype=torch.float64)
            try:
                dist.all_reduce(t)
                ok = True
            except RuntimeError:
                ok = False
            assert ok == works, spec
        finally:
            dist.destroy_process_group()

"""One environment prefix, POCKETLLM_*: the seed's QWEN_COMM_OVERLAP_SLICES and QWEN_GDN_KERNEL are
still read when the new name is unset, the new name wins when both are set, and an error names the
variable the user set; the seed's --nccl-id-path still names the rendezvous file."""

from __future__ import annotations

import pytest
import torch

import pocketllm.ops.gated_delta.backends as backends
from conftest import main_in_process, usage_error_in_process
from pocketllm.distributed.policy import resolve_ceiling, resolve_policy
from pocketllm.model_args import add_rank_args
from pocketllm.ops.gated_delta import plan_gdn_kernel
from pocketllm.ops.gated_delta.naive import gated_delta_rule_recurrent


@pytest.mark.parametrize(
    "env, ceiling",
    [
        ({"QWEN_COMM_OVERLAP_SLICES": "8"}, 8),
        ({"POCKETLLM_COMM_OVERLAP_SLICES": "2", "QWEN_COMM_OVERLAP_SLICES": "8"}, 2),
        ({"POCKETLLM_COMM_OVERLAP_SLICES": "", "QWEN_COMM_OVERLAP_SLICES": "8"}, 8),
    ],
    ids=["alias-alone", "new-name-wins", "empty-new-name-is-unset"],
)
def test_the_seeds_slice_ceiling_is_an_alias(env, ceiling):
    assert resolve_policy(env=env).policy.ceiling == ceiling
    assert resolve_ceiling(env=env) == ceiling


def test_a_bad_alias_value_names_the_alias(capsys, no_ranks, monkeypatch):
    monkeypatch.setenv("QWEN_COMM_OVERLAP_SLICES", "abc")
    line = usage_error_in_process(capsys, "policy", "--rows", "4096")
    assert line == "pocketllm: error: QWEN_COMM_OVERLAP_SLICES must be a non-negative integer, got 'abc'"


def test_policy_command_reads_the_alias(capsys, monkeypatch):
    monkeypatch.delenv("POCKETLLM_COMM_OVERLAP_SLICES", raising=False)
    monkeypatch.setenv("QWEN_COMM_OVERLAP_SLICES", "8")
    assert main_in_process("policy", "--rows", "8192") == 0
    assert capsys.readouterr().out.split() == ["rows=8192", "slices=8"]


@pytest.mark.parametrize(
    "env, name, source",
    [
        ({"QWEN_GDN_KERNEL": "recurrent"}, "recurrent", "QWEN_GDN_KERNEL"),
        ({"POCKETLLM_GDN_KERNEL": "chunk", "QWEN_GDN_KERNEL": "recurrent"}, "chunk", "POCKETLLM_GDN_KERNEL"),
    ],
    ids=["alias-alone", "new-name-wins"],
)
def test_the_seeds_gdn_kernel_is_an_alias(env, name, source, monkeypatch):
    choice = plan_gdn_kernel("cpu", torch.float32, env)
    assert (choice.name, choice.reason) == (name, f"forced by {source}")
    monkeypatch.setattr(backends, "_selected", {})
    kernel = backends.select_gdn_kernel("cpu", torch.float32, env=env)
    assert kernel.name == name
    assert (kernel.prefill is gated_delta_rule_recurrent) == (name == "recurrent")


def test_an_impossible_alias_kernel_names_the_alias():
    with pytest.raises(backends.GdnKernelError, match=r"^QWEN_GDN_KERNEL=fla needs --device cuda"):
        plan_gdn_kernel("cpu", torch.float32, {"QWEN_GDN_KERNEL": "fla"})


@pytest.mark.parametrize("flag", ["--rendezvous-file", "--nccl-id-path"])
def test_the_rendezvous_file_flag_and_its_alias(flag):
    import argparse

    p = argparse.ArgumentParser()
    add_rank_args(p)
    assert p.parse_args([flag, "/tmp/run.id"]).rendezvous_file == "/tmp/run.id"

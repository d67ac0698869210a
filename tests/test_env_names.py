"""One environment prefix, POCKETLLM_*, and one list of every variable pocketllm reads
(pocketllm/switches.py): the seed's names (QWEN_COMM_OVERLAP_SLICES, QWEN_GDN_KERNEL,
QWEN_PHASE_PROFILE, QWEN_HOST_PROFILE, POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS) are read when the new
name is unset, the new name wins when both are set (and the run says so once), and an error names
the variable the user set; a set POCKETLLM_* or QWEN_* variable nothing reads is one warning naming
the nearest that is; the seed's --nccl-id-path still names the rendezvous file."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

import pocketllm.ops.gated_delta.backends as backends
from conftest import REPO, main_in_process, usage_error_in_process
from pocketllm import cli, switches
from pocketllm.distributed.rendezvous import wait_seconds
from pocketllm.distributed.policy import resolve_ceiling, resolve_policy
from pocketllm.model_args import add_rank_args
from pocketllm.ops.gated_delta import plan_gdn_kernel
from pocketllm.ops.gated_delta.recurrent import gated_delta_rule_recurrent
from pocketllm.profiling.options import profile_options


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
    p = argparse.ArgumentParser()
    add_rank_args(p)
    assert p.parse_args([flag, "/tmp/run.id"]).rendezvous_file == "/tmp/run.id"


@pytest.mark.parametrize(
    "env, seconds",
    [
        ({"POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS": "500"}, 5.0),
        ({"POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS": "200", "POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS": "500"}, 2.0),
        ({}, 120.0),
    ],
    ids=["alias-alone", "new-name-wins", "default"],
)
def test_the_seeds_rendezvous_wait_is_an_alias(env, seconds):
    assert wait_seconds(env) == seconds


def test_a_bad_rendezvous_wait_names_the_alias():
    with pytest.raises(switches.UsageError, match="^POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS must be a positive integer, got 'soon'$"):
        wait_seconds({"POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS": "soon"})


@pytest.mark.parametrize(
    "env, phase, host",
    [
        ({"QWEN_PHASE_PROFILE": "1"}, True, False),
        ({"QWEN_HOST_PROFILE": "1"}, False, True),
        ({"POCKETLLM_PHASE_PROFILE": "0", "QWEN_PHASE_PROFILE": "1"}, False, False),
    ],
    ids=["phase-alias", "host-alias", "new-name-wins"],
)
def test_the_seeds_profile_switches_are_aliases(env, phase, host):
    options = profile_options(env=env)
    assert (options.phase, options.host) == (phase, host)


def _names_in(path) -> set[str]:
    return set(re.findall(r"\b(?:POCKETLLM|QWEN)_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))


def test_every_variable_the_package_names_is_in_the_one_list():
    # A reader added without its name in switches.SETTINGS fails here, and a listed name that
    # nothing outside the list reads any more fails too: the list is what the warning trusts.
    listed = {*switches.SETTINGS, *switches.INTERNAL}
    named: dict[str, set[str]] = {}
    for path in (REPO / "pocketllm").rglob("*"):
        if path.suffix == ".py" and path.name != "switches.py":
            for name in _names_in(path):
                named.setdefault(name, set()).add(str(path.relative_to(REPO)))
    unlisted = {n: sorted(p) for n, p in named.items() if n not in listed and n not in switches.ALIASES.values()}
    assert unlisted == {}, "add these to pocketllm/switches.py SETTINGS"
    assert sorted(listed - set(named)) == [], "listed in pocketllm/switches.py but named nowhere else in the package"


def test_a_reader_must_name_a_listed_variable():
    with pytest.raises(KeyError, match="POCKETLLM_CPUS_KERNEL"):
        switches.env_switch({}, "POCKETLLM_CPUS_KERNEL")


def test_an_unread_variable_is_one_warning_naming_the_nearest(capsys, no_ranks, monkeypatch):
    monkeypatch.setenv("POCKETLLM_PIN_SLICE", "2")
    monkeypatch.setenv("QWEN_PHASE_PROFILES", "1")
    # A known name with a word added: that name, though another is closer by spelling.
    monkeypatch.setenv("POCKETLLM_CPUS_KERNEL", "c")
    assert main_in_process("policy", "--rows", "512") == 0
    out, err = capsys.readouterr()
    assert out.split() == ["rows=512", "slices=1"]
    assert err.splitlines() == [
        "pocketllm: warning: POCKETLLM_CPUS_KERNEL is set but pocketllm reads no such variable, so it does nothing; the nearest it reads is POCKETLLM_CPUS",
        "pocketllm: warning: POCKETLLM_PIN_SLICE is set but pocketllm reads no such variable, so it does nothing; the nearest it reads is POCKETLLM_PIN_SLICES",
        "pocketllm: warning: QWEN_PHASE_PROFILES is set but pocketllm reads no such variable, so it does nothing; the nearest it reads is QWEN_PHASE_PROFILE",
    ]


@pytest.mark.parametrize("seeds, note", [("8", True), ("2", False)], ids=["different", "same"])
def test_both_names_set_say_which_is_used(seeds, note, capsys, no_ranks, monkeypatch):
    monkeypatch.setenv("POCKETLLM_COMM_OVERLAP_SLICES", "2")
    monkeypatch.setenv("QWEN_COMM_OVERLAP_SLICES", seeds)
    assert main_in_process("policy", "--rows", "8192") == 0
    out, err = capsys.readouterr()
    assert out.split() == ["rows=8192", "slices=2"]
    expected = ["pocketllm: note: POCKETLLM_COMM_OVERLAP_SLICES=2 and QWEN_COMM_OVERLAP_SLICES=8 are both set; using POCKETLLM_COMM_OVERLAP_SLICES=2"]
    assert err.splitlines() == (expected if note else [])


@pytest.mark.parametrize(
    "env, tp_rank, speaks",
    [
        ({}, None, True),
        ({}, 0, True),
        ({}, 1, False),
        ({"POCKETLLM_LAUNCH_RANK": "0"}, None, False),
        ({"RANK": "0", "WORLD_SIZE": "2"}, None, True),
        ({"RANK": "1", "WORLD_SIZE": "2"}, None, False),
    ],
    ids=["one-process", "hand-started-rank-0", "hand-started-rank-1", "launched-rank", "torchrun-rank-0", "torchrun-rank-1"],
)
def test_the_environment_is_read_out_once_per_run(env, tp_rank, speaks):
    # The launcher (or rank 0 where there is none) warns; the ranks it starts do not repeat it.
    assert cli._starts_the_run(argparse.Namespace(tp_rank=tp_rank), env) is speaks


@pytest.mark.parametrize("name", [*switches.SWITCHES, "POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS"])
def test_a_bad_value_is_refused_at_start_wherever_the_run_would_not_read_it(name, capsys, no_ranks, monkeypatch):
    # A launcher's run of CPU ranks reads neither POCKETLLM_CUDA_GRAPH nor the hand-started
    # rendezvous bound: a bad value was accepted silently there, and refused elsewhere.
    assert name in switches.SETTINGS
    monkeypatch.setenv(name, "maybe")
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--tp-world", "2", expect=f"{name}")

"""The seam that picks a gated-delta-rule kernel, on CPU: the fla and torch_npu adapters called
through stand-ins bound to those libraries' signatures (tests/kernel_stand_ins.py), the probe that
must pass before a device kernel is trusted, the choice for every (device, dtype, env), and the
usage errors a run that asks for an impossible kernel or device gets before any rank starts."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch

import pocketllm.ops.gated_delta.backends as backends
from kernel_stand_ins import (
    FLA_VERSION,
    RECORDED_FLA,
    FlaStandIn,
    NpuStandIn,
    fla_installed,
    install_fla,
    install_torch_npu,
    installed_fla_signatures,
    shape_of,
)
from conftest import main_in_process, usage_error_in_process
from pocketllm.ops.gated_delta import GdnKernelError, gated_delta_rule_chunked, gated_delta_rule_recurrent, gated_delta_step_torch_
from pocketllm.ops.gated_delta.naive import gated_delta_step_reference_
from pocketllm.ops.gated_delta.backends import KernelChoice, probe, select_gdn_kernel, torch_kernel
from pocketllm.ops.gdn_choice import CHOICES, choose_gdn_kernel
from pocketllm.ops.gated_delta import fla_adapter
from pocketllm.ops.gated_delta.fla_adapter import fla_decode_rows_, fla_decode_step_, fla_prefill
from numerics import assert_close_rel
from test_gated_delta import make_inputs, reference_f64

CPU = torch.device("cpu")
HEADS = [pytest.param(1, 3, id="Hk1-Hv3"), pytest.param(2, 2, id="Hk2-Hv2"), pytest.param(2, 6, id="Hk2-Hv6")]


@pytest.fixture
def fla(monkeypatch):
    stand_in = FlaStandIn(installed_fla_signatures() if fla_installed() else RECORDED_FLA)
    install_fla(monkeypatch, stand_in)
    # No layout tuned yet, and a tuning length the stand-in's per-token reference runs quickly.
    monkeypatch.setattr(fla_adapter, "_tuned", set())
    monkeypatch.setattr(fla_adapter, "TUNE_ROWS", 96)
    return stand_in


@pytest.mark.skipif(not fla_installed(), reason="fla is not installed: the recorded signatures stand in")
def test_recorded_fla_signatures_are_the_installed_ones():
    import fla

    assert fla.__version__ == FLA_VERSION, "re-record RECORDED_FLA and the cuda extra's pin for this fla"
    installed = installed_fla_signatures()
    for name, recorded in RECORDED_FLA.items():
        assert shape_of(installed[name]) == shape_of(recorded), name


@pytest.mark.parametrize("Hk, Hv", HEADS)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero", "state"])
def test_fla_prefill_through_its_signature(fla, Hk, Hv, with_state):
    q, k, v, g, beta, state = make_inputs(70, Hk, Hv, 16, 8)
    v = v.to(torch.bfloat16)
    initial = state if with_state else None
    out, final = fla_prefill(q, k, v, g, beta, initial)
    ref_out, ref_state = reference_f64(q, k, v, g, beta, initial)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert_close_rel(out, ref_out, tol=3e-2)
    assert_close_rel(final, ref_state, tol=3e-2)
    (_, call) = fla.calls[-1]
    # fla groups value heads itself: q and k reach it at key heads, in v's dtype.
    assert call["q"].shape[2] == Hk and call["q"].dtype == torch.bfloat16


def test_the_first_fla_prefill_at_a_layout_is_preceded_by_one_at_the_tuning_length(fla):
    """fla's autotuners keep the configs the first call at a head layout timed, for every length
    after it: a short first prompt would pick them by launch cost. The first call at each layout
    (heads, dims, dtypes, with or without a state) is preceded by one of TUNE_ROWS rows like it; the
    caller's state and result are its own."""
    rows = fla_adapter.TUNE_ROWS

    def called(T, Hk=1, Hv=3, with_state=True):
        q, k, v, g, beta, state = make_inputs(T, Hk, Hv, 16, 8)
        v = v.to(torch.bfloat16)
        before, initial = len(fla.calls), (state if with_state else None)
        kept = None if initial is None else initial.clone()
        out, final = fla_prefill(q, k, v, g, beta, initial)
        if initial is not None:
            assert torch.equal(initial, kept)
        ref_out, ref_state = reference_f64(q, k, v, g, beta, initial)
        assert_close_rel(out, ref_out, tol=3e-2)
        assert_close_rel(final, ref_state, tol=3e-2)
        new = [c for _, c in fla.calls[before:]]
        assert new[-1]["q"].shape[1] == T
        return new[:-1]

    def like(tune, Hk=1, Hv=3, with_state=True):
        assert tune["q"].shape == (1, rows, Hk, 16) and tune["v"].shape == (1, rows, Hv, 8)
        assert [tune[n].dtype for n in ("q", "k", "v", "g", "beta")] == [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
        assert (tune["initial_state"] is not None) == with_state and tune["output_final_state"]

    (tune,) = called(5)
    like(tune)
    assert called(7) == []  # tuned at this layout already
    (tune,) = called(7, with_state=False)  # no state: another kernel variant, another key
    like(tune, with_state=False)
    (tune,) = called(9, Hk=2, Hv=6)
    like(tune, Hk=2, Hv=6)
    assert called(rows, Hk=2, Hv=2) == []  # a first call that long tunes as it runs
    assert called(3, Hk=2, Hv=2) == []


def test_a_tuning_call_that_fails_leaves_the_kernel_to_the_call_itself(monkeypatch, fla):
    """The tuning call is a speed aid: one the device cannot run (out of memory beside a model,
    say) must not fail the call after it, nor the probe that decides whether fla runs at all."""
    real = fla.chunk_gated_delta_rule

    def short_only(*args, **kwargs):
        if args[0].shape[1] == fla_adapter.TUNE_ROWS:
            raise RuntimeError("CUDA out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(sys.modules["fla.ops.gated_delta_rule"], "chunk_gated_delta_rule", short_only)
    _planned(monkeypatch, "fla")
    assert select_gdn_kernel(CPU, torch.bfloat16, env={}, layout=(1, 3, 16, 8)).name == "fla"


@pytest.mark.parametrize("Hk, Hv", HEADS)
def test_fla_decode_step_advances_the_state_through_its_signature(fla, Hk, Hv):
    q, k, v, g, beta, state = make_inputs(1, Hk, Hv, 16, 8)
    v = v.to(torch.bfloat16)
    mine, ref = state.clone(), state.clone()
    out = fla_decode_step_(q, k, v, g, beta, mine)
    ref_out = gated_delta_step_reference_(q, k, v, g, beta, ref)
    assert_close_rel(out, ref_out, tol=3e-2)
    assert_close_rel(mine, ref, tol=3e-2)
    (name, call), = fla.calls
    assert name == "fused_recurrent_gated_delta_rule" and call["gk"] is None and call["beta"] is not None


@pytest.mark.parametrize("Hk, Hv", HEADS)
def test_fla_decode_rows_advance_each_sequence_from_its_own_state_through_its_signature(fla, Hk, Hv):
    # Three sequences' tokens, each with its own state: fla's batch is the sequences.
    q, k, v, g, beta, _ = make_inputs(3, Hk, Hv, 16, 8)
    v = v.to(torch.bfloat16)
    states = torch.randn(3, Hv, 16, 8, generator=torch.Generator().manual_seed(5)) * 0.1
    mine = states.clone()
    out = fla_decode_rows_(q, k, v, g, beta, mine)
    for b in range(3):
        ref = states[b].clone()
        ref_out = gated_delta_step_reference_(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], ref)
        assert_close_rel(out[b : b + 1], ref_out, tol=3e-2)
        assert_close_rel(mine[b], ref, tol=3e-2)
    (name, call), = fla.calls
    assert name == "fused_recurrent_gated_delta_rule" and call["q"].shape[:2] == (3, 1) and call["initial_state"].shape[0] == 3


@pytest.mark.parametrize("takes_fp32_state", [True, False], ids=["fp32-state", "bf16-state-only"])
def test_npu_prefill_through_its_schema_keeps_the_state_fp32_where_it_can(monkeypatch, takes_fp32_state):
    op = NpuStandIn(takes_fp32_state)
    install_torch_npu(monkeypatch, op)
    kernel, why = backends._npu_kernel(KernelChoice("npu", "test"), CPU, torch.bfloat16)
    assert why is None and kernel.decode_step_ is gated_delta_step_torch_
    assert ("fp32 state" in kernel.reason) == takes_fp32_state, kernel.reason
    op.calls.clear()
    q, k, v, g, beta, state = make_inputs(40, 2, 4, 16, 8)
    v = v.to(torch.bfloat16)
    out, final = kernel.prefill(q, k, v, g, beta, state)
    ref_out, ref_state = reference_f64(q, k, v, g, beta, state)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert_close_rel(out, ref_out, tol=3e-2)
    assert_close_rel(final, ref_state, tol=3e-2)
    (call,) = op.calls
    sent = call["initial_state"]
    if takes_fp32_state:
        assert sent.dtype == torch.float32 and torch.equal(sent[0].transpose(-1, -2), state), "the fp32 state must reach the op unrounded"


def test_npu_op_that_fails_both_probes_is_not_trusted(monkeypatch):
    class Broken(NpuStandIn):
        def npu_chunk_gated_delta_rule(self, *args, **kwargs):
            raise RuntimeError("aclnnChunkGatedDeltaRule: not supported on this SoC\ndetail")

    install_torch_npu(monkeypatch, Broken(True))
    kernel, why = backends._npu_kernel(KernelChoice("npu", "test"), CPU, torch.bfloat16)
    assert kernel is None
    assert why.count("RuntimeError: aclnnChunkGatedDeltaRule: not supported on this SoC") == 2 and "\n" not in why


def test_probe_catches_a_kernel_that_ignores_beta():
    def no_beta(q, k, v, g, beta, initial_state=None):
        return gated_delta_rule_chunked(q, k, v, g, torch.ones_like(beta), initial_state)

    why = probe(no_beta, gated_delta_step_torch_, CPU, torch.float32)
    assert why is not None and why.startswith("disagrees with the reference: prefill out")
    assert probe(gated_delta_rule_chunked, gated_delta_step_torch_, CPU, torch.float32) is None


def _planned(monkeypatch, name: str):
    monkeypatch.setattr(backends, "plan_gdn_kernel", lambda device_type, dtype, env: KernelChoice(name, "planned"))
    monkeypatch.setattr(backends, "_selected", {})


def test_an_unforced_device_kernel_failing_its_probe_gives_way_to_chunk(monkeypatch):
    class Wrong(FlaStandIn):
        def fused_recurrent_gated_delta_rule(self, *args, **kwargs):
            out, final = super().fused_recurrent_gated_delta_rule(*args, **kwargs)
            return out, final * 2

    install_fla(monkeypatch, Wrong(RECORDED_FLA))
    _planned(monkeypatch, "fla")
    kernel = select_gdn_kernel(CPU, torch.bfloat16, env={})
    assert kernel.name == "chunk" and kernel.prefill is gated_delta_rule_chunked
    assert "fla failed its probe (disagrees with the reference: decode state" in kernel.reason


def test_a_forced_device_kernel_failing_its_probe_is_a_usage_error(monkeypatch):
    class OutOfResources(FlaStandIn):
        def chunk_gated_delta_rule(self, *args, **kwargs):
            raise RuntimeError("out of resource: shared memory")

    install_fla(monkeypatch, OutOfResources(RECORDED_FLA))
    _planned(monkeypatch, "fla")
    with pytest.raises(GdnKernelError, match=r"^POCKETLLM_GDN_KERNEL=fla failed its probe on cpu: RuntimeError: out of resource: shared memory$"):
        select_gdn_kernel(CPU, torch.bfloat16, env={"POCKETLLM_GDN_KERNEL": "fla"})


def test_a_passing_device_kernel_is_probed_once_and_kept(monkeypatch, fla):
    _planned(monkeypatch, "fla")
    first = select_gdn_kernel(CPU, torch.bfloat16, env={})
    calls = len(fla.calls)
    # The probe: a prefill (after its layout's tuning call), a decode step and a decode of two
    # sequences' rows.
    assert first.name == "fla" and first.prefill is fla_prefill and first.decode_step_ is fla_decode_step_ and calls == 4
    assert first.decode_rows_indexed_.args == (fla_decode_rows_,)  # fla's rows, gathered and put back
    assert select_gdn_kernel(CPU, torch.bfloat16, env={}) is first and len(fla.calls) == calls


def test_a_device_kernel_is_probed_at_the_callers_head_layout_once_per_layout(monkeypatch, fla):
    """A device kernel compiles (fla autotunes) once per head layout: probed at a layout of its
    own, a first start would pay for two. Each layout is probed at itself, once; a model's GDN
    layers ask at their own heads and head dims."""
    _planned(monkeypatch, "fla")
    first = select_gdn_kernel(CPU, torch.bfloat16, env={}, layout=(1, 3, 16, 8))
    assert {(c["q"].shape[2:], c["v"].shape[2:]) for _, c in fla.calls} == {((1, 16), (3, 8))}
    assert select_gdn_kernel(CPU, torch.bfloat16, env={}, layout=(1, 3, 16, 8)) is first
    calls = len(fla.calls)
    select_gdn_kernel(CPU, torch.bfloat16, env={}, layout=(2, 4, 8, 16))
    assert {(c["q"].shape[2:], c["v"].shape[2:]) for _, c in fla.calls[calls:]} == {((2, 8), (4, 16))}

    from pocketllm.distributed.state import set_tp
    from pocketllm.layers import gdn
    from pocketllm.models.qwen3_5 import Qwen35ForCausalLM
    from pocketllm.presets import get_preset

    asked = []
    monkeypatch.setattr(gdn, "select_gdn_kernel", lambda device, dtype, layout: asked.append(layout) or torch_kernel("chunk", "test"))
    cfg = get_preset("tiny")
    set_tp(0, 1)
    Qwen35ForCausalLM(cfg, torch.float32, torch.device("meta"))
    layout = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    assert asked and set(asked) == {layout}


DEVICES = ("cpu", "cuda", "npu", "mps")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTO = {
    # (device, have_fla, have_npu_op) -> kernel per dtype (float32, bfloat16, float16)
    ("cuda", True, False): ("chunk", "fla", "fla"),
    ("cuda", True, True): ("chunk", "fla", "fla"),
    ("npu", False, True): ("chunk", "npu", "chunk"),
    ("npu", True, True): ("chunk", "npu", "chunk"),
}


@pytest.mark.parametrize("device, have_fla, have_npu", list(itertools.product(DEVICES, (False, True), (False, True))))
def test_unforced_choice(device, have_fla, have_npu):
    expected = AUTO.get((device, have_fla, have_npu), ("chunk",) * 3)
    for dtype, name in zip(DTYPES, expected):
        choice = choose_gdn_kernel(device, dtype, "", have_fla, have_npu)
        assert choice.name == name, (device, dtype, have_fla, have_npu, choice)
        if name == "chunk" and (device, have_fla) == ("cuda", True):
            assert "TF32" in choice.reason
        if name == "chunk" and (device, have_npu) == ("npu", True):
            assert "bfloat16-only" in choice.reason
        if (device, have_fla) == ("cuda", False) and dtype != torch.float32:
            assert choice.reason.endswith("fla is not installed (pip install -e '.[cuda]')"), choice


def test_a_rank_says_it_probes_fla_before_a_first_starts_long_quiet_compile(monkeypatch):
    """fla's probe is its first call at the layers' heads: on a machine's first start it compiles
    and tunes for a minute or two before the load bar. Rank 0 says so where fla is planned, and
    only there."""
    from pocketllm.ops import gdn_choice
    from pocketllm.ops.gdn_choice import probe_note

    monkeypatch.setattr(gdn_choice, "fla_importable", lambda: True)

    assert probe_note("cuda", torch.bfloat16, env={}).startswith("gdn kernel: probing fla at the layers' heads")
    assert probe_note("cuda", torch.float32, env={}) is None  # the torch chunked kernel (fla's fp32 is TF32)
    assert probe_note("cuda", torch.bfloat16, env={"POCKETLLM_GDN_KERNEL": "chunk"}) is None
    assert probe_note("cpu", torch.bfloat16, env={}) is None


def _forced_ok(forced, device, dtype, have_fla, have_npu) -> bool:
    if forced in ("chunk", "recurrent"):
        return True
    if forced == "fla":
        return device in ("cuda", "npu") and have_fla and dtype != torch.float32
    return device == "npu" and have_npu and dtype == torch.bfloat16


@pytest.mark.parametrize("forced", [*CHOICES, "bogus"])
def test_forced_choice_for_every_device_dtype_and_library(forced):
    for device, dtype, have_fla, have_npu in itertools.product(DEVICES, DTYPES, (False, True), (False, True)):
        case = (forced, device, dtype, have_fla, have_npu)
        if forced != "bogus" and _forced_ok(*case):
            assert choose_gdn_kernel(device, dtype, f" {forced.upper()} ", have_fla, have_npu) == KernelChoice(forced, "forced by POCKETLLM_GDN_KERNEL"), case
            continue
        with pytest.raises(GdnKernelError) as info:
            choose_gdn_kernel(device, dtype, forced, have_fla, have_npu)
        line = str(info.value)
        assert "\n" not in line and f"POCKETLLM_GDN_KERNEL={forced}" in line.replace("'", ""), case
        assert "chunk" in line, case


def test_torch_kernels_run_on_cpu_as_named(monkeypatch):
    monkeypatch.setattr(backends, "_selected", {})
    assert select_gdn_kernel(CPU, torch.float32, env={}).prefill is gated_delta_rule_chunked
    kernel = select_gdn_kernel(CPU, torch.float32, env={"POCKETLLM_GDN_KERNEL": "recurrent"})
    assert kernel.name == "recurrent" and kernel.prefill is gated_delta_rule_recurrent
    q, k, v, g, beta, _ = make_inputs(10, 1, 2, 8, 8)
    out, state = kernel.prefill(q[:9], k[:9], v[:9], g[:9], beta[:9], None)
    last = kernel.decode_step_(q[9:], k[9:], v[9:], g[9:], beta[9:], state)
    ref_out, ref_state = reference_f64(q, k, v, g, beta)
    assert_close_rel(torch.cat([out, last]), ref_out)
    assert_close_rel(state, ref_state)


@pytest.mark.parametrize(
    "env, flags, expect",
    [
        ({"POCKETLLM_GDN_KERNEL": "fla"}, ("--device", "cpu"), "POCKETLLM_GDN_KERNEL=fla needs --device cuda"),
        ({"POCKETLLM_GDN_KERNEL": "npu"}, ("--device", "cpu", "--dtype", "float32"), "POCKETLLM_GDN_KERNEL=npu needs --device npu"),
        ({"POCKETLLM_GDN_KERNEL": "bogus"}, (), "valid: chunk, recurrent, fla, npu"),
        ({}, ("--device", "foo"), "--device 'foo' is not one of auto, cpu, cuda, npu"),
    ],
    ids=["fla-on-cpu", "npu-on-cpu", "unknown-kernel", "unknown-device"],
)
def test_an_impossible_kernel_or_device_starts_no_rank(no_ranks, monkeypatch, capsys, env, flags, expect):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", 2, *flags, expect=expect)


@pytest.mark.parametrize("forced", ["", "recurrent"], ids=["default", "forced-recurrent"])
def test_bench_prints_the_kernel_once_and_writes_it_to_json(monkeypatch, capsys, tmp_path, forced):
    monkeypatch.setenv("POCKETLLM_GDN_KERNEL", forced)
    out = tmp_path / "bench.json"
    rc = main_in_process("bench", "--preset", "tiny", "--device", "cpu", "--prompt-tokens", 8, "--max-new-tokens", 1, "--warmup-tokens", 4, "--json", out)
    assert rc == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdn kernel: ")]
    name = forced or "chunk"
    assert lines == [f"gdn kernel: {name} ({'forced by POCKETLLM_GDN_KERNEL' if forced else 'torch chunked kernel on cpu'})"]
    settings = json.loads(out.read_text())["settings"]
    assert settings["gdn_kernel"] == name and "gdn kernel: " + settings["gdn_kernel_line"] == lines[0]
    # What a device's pass would run between its GEMMs: on a CPU the torch forms, said so.
    assert settings["device_ops"] == "device ops: torch"

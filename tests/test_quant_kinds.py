"""The registry's kinds for int8/int4 weights: each family's one-row, few-row and many-row kinds
hold the plain torch form (never timed) and the candidates of pocketllm.ops.quant, forcing and its
one-line errors (before any rank), a bound quantized projection running the kernel chosen for
each row count, and torch's int4 layout never held beside the loaded weight unless forced.
(Each candidate against the reference: test_quant_kernels.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import usage_error_in_process

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops.quant import candidates as qc
from pocketllm.ops.quant import native, torch_ops
from pocketllm.ops.quant.layout import quant_linear_reference, quantize
from pocketllm.ops.registry import FEW, MANY, ONE, Choice, KernelSet, Monitor, check_forced, choose, kind_for
from pocketllm.ops.registry import quant_kinds

TOLERANT = Monitor(others_share=float("inf"), steal_share=float("inf"))


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    return tmp_path


def int4(out=48, cols=256, group=64, symmetric=True, seed=0):
    torch.manual_seed(seed)
    return quantize(torch.randn(out, cols), "int4", group, symmetric, torch.bfloat16)


def int8(out=48, cols=256, seed=0):
    torch.manual_seed(seed)
    return quantize(torch.randn(out, cols), "int8", scale_dtype=torch.bfloat16)


def test_each_family_has_every_row_class_with_the_reference_and_the_quant_candidates():
    cpu = torch.device("cpu")
    for family, fmt in (("int8", "int8"), ("int4", "int4-g128-asym"), ("int4", "int4-g128")):
        for rows, listed in ((ONE, qc.ONE_ROW), (FEW, qc.FEW_ROW), (MANY, qc.MANY_ROW)):
            kind = kind_for(fmt, rows)
            assert kind is quant_kinds.KINDS[(family, rows)] and kind.setting == f"{family}-{rows}"
            names = [c.name for c in kind.candidates]
            assert names[0] == "torch" and kind.default == "torch" and not kind.by_name["torch"].measured
            # Every candidate that can run the format is timed; c-int8x only int8's and int4's
            # symmetric ones.
            assert set(kind.timed(fmt, cpu)) == {c.name for c in listed if not c.unavailable(fmt, cpu)}
            assert ("c-int8x" in names) == (rows != MANY)
            assert ("c-int8x" in kind.timed(fmt, cpu)) == (rows != MANY and not fmt.endswith("asym"))
            assert kind.timed(fmt, cpu) == [n for n in names[1:] if not kind.by_name[n].unavailable(fmt, cpu)]


def test_the_torch_form_equals_the_reference_past_its_row_blocks(monkeypatch):
    monkeypatch.setattr(torch_ops, "DEQUANT_ROWS", 16)
    qw = int4(out=37)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    want, got = torch.empty(3, 37, dtype=torch.bfloat16), torch.empty(3, 37, dtype=torch.bfloat16)
    quant_linear_reference(x, qw, want)
    torch_ops.quant_linear_torch(x, qw, got)
    assert torch.equal(got, want)
    one = torch.empty(37, dtype=torch.bfloat16)
    torch_ops.quant_linear_torch_one(x[0], qw, one)
    assert torch.equal(one, want[0])


def test_forcing_a_quantized_kernel_and_its_one_line_errors():
    gemv = quant_kinds.KINDS[("int4", ONE)]
    with pytest.raises(UsageError, match="POCKETLLM_KERNELS: int4-one-row='int8pack' is not an int4 one-row kernel: use auto, torch, c, c-prefetch, c-prefetch-far, c-ahead, c-l2, c-int8x, c-int8x-l2, int4pack"):
        gemv.forced({"POCKETLLM_KERNELS": "int4-one-row=int8pack"})
    with pytest.raises(UsageError, match="POCKETLLM_KERNELS=int4-one-row=c: the compiled quantized kernels run on a CPU"):
        check_forced(["int4-g128"], "cuda", {"POCKETLLM_KERNELS": "int4-one-row=c"})
    with pytest.raises(UsageError, match="take groups of 32 or a multiple of 64, not 96"):
        check_forced(["int4-g96"], "cpu", {"POCKETLLM_KERNELS": "int4-one-row=c-prefetch"})
    # A forced int8 kernel says nothing about a run that holds int4 weights only.
    check_forced(["int4-g128"], "cpu", {"POCKETLLM_KERNELS": "int8-one-row=int8pack"})
    forced = choose(gemv, [int4(), int4(out=16)], env={"POCKETLLM_KERNELS": "int4-one-row=torch"})
    assert forced.how == "forced" and set(forced.by_key.values()) == {"torch"}


def test_the_cli_refuses_a_bad_quantized_kernel_before_any_rank(no_ranks, capsys, monkeypatch):
    monkeypatch.setenv("POCKETLLM_KERNELS", "int8-many-row=fastest")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--quantize", "int8", "--tp-world", "2", expect=("POCKETLLM_KERNELS: int8-many-row='fastest'", "auto, torch"))


def test_a_measured_choice_never_times_the_torch_form(cache_dir):
    weights = [int8(), int8(out=16, seed=1)]
    chosen = choose(quant_kinds.KINDS[("int8", ONE)], weights, env={}, monitor=TOLERANT)
    assert chosen.how == "measured"
    for seconds in chosen.seconds.values():
        assert "torch" not in seconds and set(seconds) >= {"c", "c-prefetch"}


def test_a_bound_quantized_projection_runs_the_kernel_chosen_for_each_row_count():
    qw = int4(out=40, group=32, symmetric=False)
    fmt, key = "int4-g32-asym", (40, 256)
    kernels = KernelSet([
        Choice(quant_kinds.KINDS[("int4", ONE)], fmt, "forced", {key: "c-prefetch"}),
        Choice(quant_kinds.KINDS[("int4", FEW)], fmt, "forced", {key: "c"}, rows=4),
        Choice(quant_kinds.KINDS[("int4", MANY)], fmt, "forced", {"probe": "dequant-f32"}),
    ])
    bound = kernels.bind(qw)
    assert bound.names == {"one-row": "c-prefetch", "2-row": "c", "3-row": "c", "4-row": "c", "many-row": "dequant-f32"}
    for rows in (1, 3, 4, 5, 20):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        want = torch.empty(rows, 40, dtype=torch.bfloat16)
        quant_linear_reference(x, qw, want)
        torch.testing.assert_close(bound(x).float(), want.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(bool(native.int8x_unavailable()), reason="this CPU has neither AVX-512 VNNI nor AVX2")
def test_few_rows_follow_an_int8_x_one_row_choice_in_one_call():
    # One-row c-int8x rounds x to int8; a few-row choice of c does not. Batch-invariant, the few
    # rows take c-int8x's few-row form (each row's bits as alone), not c, and not a call per row.
    qw = int4(out=40, group=32)
    fmt, key = "int4-g32", (40, 256)
    kernels = KernelSet([
        Choice(quant_kinds.KINDS[("int4", ONE)], fmt, "forced", {key: "c-int8x"}),
        Choice(quant_kinds.KINDS[("int4", FEW)], fmt, "forced", {key: "c"}, rows=4),
        Choice(quant_kinds.KINDS[("int4", MANY)], fmt, "forced", {"probe": "dequant-f32"}),
    ], env={"POCKETLLM_BATCH_INVARIANT": "1"})
    bound = kernels.bind(qw)
    assert bound.names == {"one-row": "c-int8x", "2-row": "c-int8x", "3-row": "c-int8x", "4-row": "c-int8x", "many-row": "dequant-f32"}
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    batch = bound(x)
    for i in range(4):
        assert torch.equal(batch[i], bound(x[i : i + 1].contiguous())[0])


def test_torch_int4_layout_is_never_held_beside_the_loaded_weight_unless_forced(monkeypatch):
    from pocketllm.ops.quant import torch_ops

    made = []
    real = torch_ops.Int4Pack.__init__

    def counting(self, qw):
        made.append(qw)
        real(self, qw)

    monkeypatch.setattr(torch_ops.Int4Pack, "__init__", counting)
    qw, fmt, key = int4(), "int4-g64", (48, 256)
    one, many = quant_kinds.KINDS[("int4", ONE)], quant_kinds.KINDS[("int4", MANY)]
    # Measured fastest, int4pack gives way to the fastest kernel of the loaded layout.
    measured = Choice(one, fmt, "measured", {key: "int4pack"}, {key: {"c": 2e-6, "c-prefetch": 1e-6, "int4pack": 5e-7}})
    kernels = KernelSet([measured, Choice(many, fmt, "measured", {"probe": "int4pack"}, {"probe": {"dequant-bf16": 3e-5, "int4pack": 1e-5}})])
    bound = kernels.bind(qw)
    assert bound.names == {"one-row": "c-prefetch", "many-row": "dequant-bf16"} and not made
    assert "48x256 c-prefetch (int4pack measured faster: it would hold a copy of the weights)" in measured.describe()
    assert measured.to_json()["runs"] == {"48x256": "c-prefetch"}
    # Forced, it runs as asked, on one prepared copy.
    forced = KernelSet([Choice(one, fmt, "forced", {key: "int4pack"}), Choice(many, fmt, "forced", {"probe": "int4pack"})]).bind(qw)
    assert forced.names == {"one-row": "int4pack", "many-row": "int4pack"} and len(made) == 1
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(forced(x).float(), bound(x).float(), atol=2e-2, rtol=2e-2)


def test_a_copying_candidate_is_timed_on_cut_copies_of_the_probe_weights(monkeypatch, cache_dir):
    from pocketllm.ops.quant import torch_ops
    from pocketllm.ops.registry import measure

    made = []
    real = torch_ops.Int4Pack.__init__

    def counting(self, qw):
        made.append(qw.shape)
        real(self, qw)

    monkeypatch.setattr(torch_ops.Int4Pack, "__init__", counting)
    weights = [int4(out=256), int4(out=128, seed=1)]
    monkeypatch.setattr(measure, "COPY_BYTES", sum(w.nbytes for w in weights) // 4)
    chosen = choose(quant_kinds.KINDS[("int4", ONE)], weights, env={}, monitor=TOLERANT)
    # A quarter of each weight's rows, once per weight; its time stands for the whole weight.
    assert sorted(made) == [(32, 256), (64, 256)]
    for seconds in chosen.seconds.values():
        assert seconds["int4pack"] > 0 and set(seconds) >= {"c-prefetch", "int4pack"}


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4-g32-asym"])
def test_a_one_row_kernel_that_takes_rows_gives_a_row_the_bits_it_gives_a_vector(fmt):
    # Bound, such a kernel gets a decode row's [1, in] / [1, out] tensors as they are: the same
    # call as on x[0] / out[0], so the same bits.
    kind = kind_for(fmt, ONE)
    w = torch.randn(37, 320, dtype=torch.bfloat16)
    if fmt != "bfloat16":
        w = int8(out=37, cols=320) if fmt == "int8" else int4(out=37, cols=320, group=32, symmetric=False)
    names = [n for n in kind.available(fmt, torch.device("cpu")) if kind.by_name[n].takes_rows]
    if not names:
        pytest.skip(f"no compiled one-row kernel for {fmt} here")
    x = torch.randn(1, 320, dtype=torch.bfloat16)
    for name in names:
        cand = kind.by_name[name]
        prepared = w if cand.prepare is None else cand.prepare(w)
        as_rows, as_vector = torch.empty(1, 37, dtype=torch.bfloat16), torch.empty(37, dtype=torch.bfloat16)
        cand.run(x, prepared, as_rows)
        cand.run(x[0], prepared, as_vector)
        assert torch.equal(as_rows[0], as_vector), name
    bound = KernelSet([Choice(kind, fmt, "forced", {(37, 320): names[-1]})]).bind(w)
    assert bound.names["one-row"] == names[-1] and torch.equal(bound.alone(x)[0], as_vector)

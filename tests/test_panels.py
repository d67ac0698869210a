"""bf16 weights in panels (pocketllm/ops/gemv/panel_bf16.c): the layout holds the weight whole,
every kernel on it sums an output as one fp32 fused multiply-add chain over its inputs in order
(so one row, a few rows and many rows give a row the same bits), the run's layout is chosen once
and printed, and an engine holding panels keeps no row-major copy. tests/test_invariance.py runs
its batch-invariance checks on both layouts. Where the CPU has no AVX2 with FMA, panels are not
offered (and these tests say so)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import main_in_process, tiny_engine, usage_error_in_process
from test_host_memory import THP_BUILT, mapping_of

from pocketllm import host_memory
from pocketllm.errors import UsageError
from pocketllm.ops.gemv import panels
from pocketllm.ops.registry import layout
from pocketllm.ops.registry.kinds import PANELS, weight_format

pytestmark = pytest.mark.skipif(bool(panels.unavailable()), reason=f"panels: {panels.unavailable()}")

# Rows inside one panel, across a panel's end and a single one; inputs odd and past a block of 128.
SHAPES = [(70, 33), (64, 128), (130, 257), (1, 5), (3, 300)]


def weight(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=g).bfloat16()


@pytest.mark.parametrize("rows,n", SHAPES)
def test_packing_keeps_every_weight_and_unpacks_to_it(rows, n):
    w = weight(rows, n)
    p = panels.pack(w)
    assert p.shape == (rows, n) and weight_format(p) == PANELS
    assert p.nbytes == -(-rows // panels.PANEL) * panels.PANEL * n * 2
    assert torch.equal(p.unpack(), w)
    # A probe cut keeps its rows, whole panels or not.
    assert torch.equal(p.rows(64, rows).unpack(), w[64:rows]) if rows > 64 else torch.equal(p.rows(0, rows).unpack(), w)
    assert torch.equal(p.rows(1, rows).unpack(), w[1:rows])


@pytest.mark.skipif(not THP_BUILT, reason="kernel built without transparent huge pages: madvise(MADV_HUGEPAGE) is refused")
def test_a_large_weights_panels_lie_on_huge_pages_and_unpack_to_it():
    # As the loaded weights do (pocketllm.host_memory): a product streams the whole weight.
    w = weight(1500, 1024)  # 24 panels, the last part padding: 3 MiB
    p = panels.pack(w)
    head = mapping_of(p.packed)
    assert head is not None and "hg" in head[1], f"panels on {head}, not advised for huge pages"
    assert p.packed.data_ptr() % host_memory.HUGE_PAGE == 0
    assert torch.equal(p.unpack(), w)
    # Unpacked back into huge pages, as an engine going back to rows does (hold_as_loaded).
    back = p.unpack(host_memory.zeros(w.shape, torch.bfloat16))
    assert torch.equal(back, w) and "hg" in mapping_of(back)[1]
    with pytest.raises(ValueError, match="unpack: out must be"):
        p.unpack(torch.empty(1500, 1023, dtype=torch.bfloat16))
    out = torch.empty(5, 1500, dtype=torch.bfloat16)
    x = weight(5, 1024, seed=2)
    panels.rows(4, 128)(x, p, out)
    assert torch.equal(out, panels.chain_reference(x, p))


@pytest.mark.parametrize("rows,n", SHAPES)
def test_one_few_and_many_rows_sum_each_output_as_one_chain(rows, n):
    w = panels.pack(weight(rows, n))
    x = weight(17, n, seed=1)
    chain = panels.chain_reference(x, w)
    # Within fp32 summation order of the plain product (the torch form, the weight unpacked).
    plain = torch.empty(x.shape[0], rows, dtype=torch.bfloat16)
    panels.unpacked(x, w, plain)
    torch.testing.assert_close(chain.float(), plain.float(), rtol=2e-2, atol=2e-2)
    out = torch.empty(rows, dtype=torch.bfloat16)
    for i in range(x.shape[0]):
        for streams, block in ((1, 32), (2, 32), (3, 7), (4, 16), (2, 1000)):
            panels.one_row(streams, block)(x[i], w, out)
            assert torch.equal(out, chain[i]), f"one row {i}, {streams} streams, blocks of {block}"
    for m in (1, 2, 3, 5, 8, 9, 17):
        for mr, kb in ((4, 128), (6, 128), (1, 16), (5, 64)):
            out = torch.empty(m, rows, dtype=torch.bfloat16)
            panels.rows(mr, kb)(x[:m], w, out)
            assert torch.equal(out, chain[:m]), f"{m} rows, {mr} at a time over {kb} inputs"


def test_a_kernel_refuses_what_it_cannot_run_in_one_line():
    w = panels.pack(weight(70, 33))
    with pytest.raises(Exception) as raised:
        panels.one_row()(torch.zeros(32, dtype=torch.bfloat16), w, torch.empty(70, dtype=torch.bfloat16))
    assert "\n" not in str(raised.value) and "x" in str(raised.value)
    with pytest.raises(ValueError, match="panels hold 2-D bfloat16 CPU weights"):
        panels.pack(torch.zeros(4, 4))


def test_the_layout_is_forced_by_its_variable_and_a_bad_value_is_a_usage_error():
    ws = [weight(130, 64), weight(64, 130)]
    assert layout.choose_layout(ws, {layout.ENV: "rows"}).layout == "rows"
    assert layout.choose_layout(ws, {layout.ENV: "panels"}).layout == "panels"
    with pytest.raises(UsageError, match=f"^{layout.ENV}='tiles': use auto, rows, panels$"):
        layout.choose_layout(ws, {layout.ENV: "tiles"})
    # Nothing in bf16 on a CPU: nothing to hold otherwise.
    assert layout.choose_layout([torch.zeros(4, 4)], {}).layout == "rows"
    # Measured: one of the two, with both layouts' figures.
    auto = layout.choose_layout(ws, {})
    assert auto.layout in ("rows", "panels") and auto.batches in ("rows", "panels") and "panels against rows (c-" in auto.why and "8 rows" in auto.why
    # A forced row-major kernel keeps rows (it runs on them).
    forced = layout.choose_layout(ws, {"POCKETLLM_KERNELS": "one-row=c"})
    assert forced.layout == "rows" and "one-row" in forced.why


def test_an_engine_in_panels_keeps_no_row_major_copy(monkeypatch):
    monkeypatch.setenv(layout.ENV, "panels")
    engine = tiny_engine(torch.bfloat16)
    projections = engine.model.projections()
    held = [m.weight for m in projections]
    assert all(isinstance(w, panels.PanelWeight) for w in held), [type(w).__name__ for w in held]
    assert not any(name.endswith("proj.weight") or "gate_up" in name or "lm_head" in name for name, _ in engine.model.named_parameters())
    assert all(set(m.kernels.names.values()) <= {"c", "c-1", "c-4", "c-6", "torch"} for m in projections)


def test_bench_prints_the_layout_and_refuses_a_bad_one(capsys, monkeypatch):
    monkeypatch.setenv(layout.ENV, "panels")
    assert main_in_process("bench", "--preset", "tiny", "--prompt-tokens", 8, "--max-new-tokens", 2) == 0
    assert f"bf16 weights: in panels ({layout.ENV}=panels)" in capsys.readouterr().err
    monkeypatch.setenv(layout.ENV, "tiles")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--prompt-tokens", 8, "--max-new-tokens", 2, expect=f"{layout.ENV}='tiles': use auto, rows, panels")


def test_an_engine_takes_the_batches_layout_when_slots_for_several_are_reserved_before_any_pass(monkeypatch):
    monkeypatch.setenv(layout.ENV, "rows")
    engine = tiny_engine(torch.bfloat16)
    engine.layout = layout.LayoutChoice("rows", "as a test says", batches="panels")
    assert engine.layout.describe(1) == "bf16 weights: as loaded (rows) (for steps of one sequence as loaded (rows), of several in panels; as a test says)"
    engine.reserve_slots(1, 64)
    assert engine.held == "rows" and isinstance(engine.model.lm_head.weight, torch.Tensor)
    before = weakref.ref(engine.model.layers[0].mlp.down.weight)
    engine.reserve_slots(4, 64)
    assert engine.held == "panels"
    # Nothing (the compiled step, the old kernels) keeps a row-major weight alive beside its panels.
    gc.collect()
    assert before() is None
    assert all(isinstance(m.weight, panels.PanelWeight) for m in engine.model.projections())
    assert engine.model.layers[0].mlp.down.kernels.names["4-row"] in ("c", "c-6")
    ids = torch.tensor([5, 6, 7])
    engine.run_packed([(0, 0, ids)])
    # Once a pass has run, the layout stays: every row of the run sums alike.
    engine.layout = layout.LayoutChoice("panels", "as a test says", batches="rows")
    engine.reserve_slots(8, 64)
    assert engine.held == "panels"


def test_choices_measured_on_panels_are_kept_for_this_placement_of_them_only():
    # The kernel and layout choices' cache keys name the panels module (which decides the memory
    # they lie on) beside the compiled source: figures from another placement are measured again.
    from pathlib import Path

    from pocketllm import compiled
    from pocketllm.ops.registry import panel_kinds
    from pocketllm.ops.registry.choose import cache_key

    module = compiled.source_digest(Path(panels.__file__))
    for kind in (panel_kinds.ONE_ROW, panel_kinds.FEW_ROW, panel_kinds.MANY_ROW):
        assert module in cache_key(kind, PANELS, (64, 128), 8)
    assert module in layout.cache_key([weight(64, 128)])


def test_the_layout_figures_are_kept_for_the_kernels_they_timed(monkeypatch):
    # Timing another set of kernels is another measurement: its figures are not the cached ones.
    key = layout.cache_key([weight(64, 128)])
    kind, names = layout.TIMED[("rows", 1)]
    monkeypatch.setitem(layout.TIMED, ("rows", 1), (kind, names[:1]))
    assert layout.cache_key([weight(64, 128)]) != key


def test_the_layouts_are_timed_on_every_weight_shape_within_the_budget():
    ws = [torch.empty(4096, 512, dtype=torch.bfloat16), torch.empty(256, 512, dtype=torch.bfloat16), torch.empty(4096, 512, dtype=torch.bfloat16)]
    ws.append(torch.empty(100_000, 64, dtype=torch.bfloat16))  # a head, bigger than its share
    probe = layout.probe_weights(ws, budget=3 << 20)
    # Three shapes, 1 MiB each: the first 4096x512 cut to 1024 rows (its share spent, the second
    # of that shape left out), the 256-row one whole, the head cut to 8192 rows of 128 bytes.
    assert [tuple(w.shape) for w in probe] == [(1024, 512), (256, 512), (8192, 64)]
    assert probe[0].data_ptr() == ws[0].data_ptr() and probe[1] is ws[1]

"""The AMX tile kernels where the CPU has them: the one-row form sums each row as the few-row tile
product does, so a batch-invariant set given the one-row form (forced) takes the tiles at every
row count, a decode row getting the same bits in any batch; a forced few-row AMX kernel without it
is refused (on any CPU); where there are no tiles, forcing them is refused naming why; and the
compiled decode step calls the one-row form as the layers do."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import feed, tiny_engine

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops.gemv import kernels as gemv
from pocketllm.ops.registry import FEW_ROW, ONE_ROW, KernelSet, check_forced

NO_TILES = gemv.amx_unavailable("bfloat16", torch.device("cpu"))
needs_tiles = pytest.mark.skipif(bool(NO_TILES), reason=NO_TILES)


@needs_tiles
def test_the_avx512f_build_leaves_the_tiles_out(monkeypatch):
    """POCKETLLM_ISA=avx512f holds the kernels to what a CPU with AVX-512 but not its BF16 runs
    (Skylake to Ice Lake), and such a CPU has no tiles: a run so held, on this CPU that has them,
    neither measures nor runs them."""
    cpu = torch.device("cpu")
    monkeypatch.setenv(compiled.ENV_ISA, "avx512f")
    assert gemv.amx_unavailable("bfloat16", cpu).startswith("no AMX tiles here")
    monkeypatch.setenv(compiled.ENV_ISA, "native")
    assert gemv.amx_unavailable("bfloat16", cpu) == ""


@needs_tiles
def test_one_row_on_the_tiles_is_each_row_of_the_few_row_tiles_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    # Widths the tiles cover, one they do not (the AVX-512 path for the whole weight), weight
    # rows past the last 16-row block.
    for out_f, n in ((64, 256), (37, 96), (48, 100), (300, 1024)):
        w = torch.randn(out_f, n, generator=g).bfloat16()
        x = torch.randn(11, n, generator=g).bfloat16()
        rows = torch.empty(11, out_f, dtype=torch.bfloat16)
        gemv.amx_rows(x, w, rows)
        for r in range(11):
            one = torch.empty(out_f, dtype=torch.bfloat16)
            gemv.amx_gemv(x[r], w, one)
            assert torch.equal(one, rows[r]), f"{out_f}x{n} row {r}"
        terms = x.float().abs() @ w.float().abs().t()
        assert bool(((rows.float() - x.float() @ w.float().t()).abs() <= 2**-7 * terms + 1e-6).all())


@needs_tiles
def test_a_batch_invariant_set_takes_the_tiles_beside_the_one_row_tiles(monkeypatch):
    w = torch.randn(64, 256).bfloat16()
    env = {"POCKETLLM_KERNELS": "one-row=amx"}
    kernels = KernelSet.choose([w], env=env)
    kernels.choose_few([w], 8)
    bound = kernels.bind(w)
    assert bound.names["one-row"] == "amx" and all(bound.names[f"{r}-row"] == "amx" for r in range(2, 9)), bound.names
    # A decode row in a batch of eight gets its bits alone.
    x = torch.randn(8, 256).bfloat16()
    alone = torch.cat([bound(x[r : r + 1]) for r in range(8)])
    assert torch.equal(bound(x), alone)
    # Beside a one-row kernel of the compiled order, no few-row choice is the tiles.
    other = KernelSet.choose([w], env={"POCKETLLM_KERNELS": "one-row=c-ahead"})
    other.choose_few([w], 8)
    assert "amx" not in other.bind(w).names.values()


def test_a_forced_few_row_tile_kernel_needs_the_one_row_tiles_beside_it():
    # The rule holds whatever the CPU: it is checked before whether the tiles are there.
    with pytest.raises(UsageError, match="force one-row=amx too"):
        check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "few-row=amx"})
    with pytest.raises(UsageError, match="sums a row otherwise"):
        check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "one-row=c,few-row=amx"})


@pytest.mark.skipif(not NO_TILES, reason="this CPU has AMX tiles")
def test_forcing_the_tiles_where_there_are_none_is_refused_naming_why():
    with pytest.raises(UsageError, match=re.escape(f"POCKETLLM_KERNELS=one-row=amx: {NO_TILES}")):
        check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "one-row=amx,few-row=amx"})


@needs_tiles
def test_forced_tiles_with_the_one_row_tiles_or_without_invariance_are_taken():
    check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "one-row=amx,few-row=amx"})
    check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "few-row=amx", "POCKETLLM_BATCH_INVARIANT": "0"})
    assert "amx" not in ONE_ROW.timed("bfloat16", torch.device("cpu")) and "amx" in FEW_ROW.timed("bfloat16", torch.device("cpu"))


@needs_tiles
def test_the_compiled_step_runs_the_one_row_tiles_as_the_layers_do(monkeypatch):
    monkeypatch.setenv("POCKETLLM_KERNELS", "one-row=amx")
    engine = tiny_engine(torch.bfloat16)
    assert engine.step is not None, engine.describe_step()
    engine.reserve_slots(2, 64)
    prompt = [(5 * i + 2) % 1000 for i in range(20)]
    for slot in (0, 1):
        feed(engine, prompt, slot=slot)
    token = 7
    for i in range(6):
        direct = feed(engine, [token], start=len(prompt) + i, slot=0).clone()
        with monkeypatch.context() as m:
            m.setattr(engine, "_direct_step", lambda *a: None)
            plain = feed(engine, [token], start=len(prompt) + i, slot=1)
        assert torch.equal(direct, plain), f"step {i}"
        token = int(torch.argmax(plain))

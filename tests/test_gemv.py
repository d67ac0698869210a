"""The one-row and few-row kernels against their plain references, which kernel a bound projection
runs at each row count, the compiled wrappers refusing bad arguments, and what happens without a
compiler. (How a kernel is chosen: test_registry.py.)"""

from __future__ import annotations

import ctypes

import pytest
import torch

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops.gemv import kernels as gemv
from pocketllm.ops.gemv.kernels import gemv_reference, rows_reference
from pocketllm.ops.registry import FEW_ROW, ONE_ROW, Choice, KernelSet, check_forced

# (out, in): a multiple of every vector width, then rows that leave a remainder after the
# four-row blocks and widths that end mid-vector.
SHAPES = [(64, 256), (7, 1000), (130, 33), (1, 5)]
CPU = torch.device("cpu")


def _fmt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_other_formats_are_offered_torch_kernels_only():
    # fp32/fp16 weights run torch's own calls (tested in torch, not here): the compiled kernels
    # take bf16 and say so for the others, which the registry then never measures or runs.
    for kind in (ONE_ROW, FEW_ROW):
        for fmt in ("float32", "float16"):
            assert set(kind.available(fmt, CPU)) <= {"mv", "mv-native", "mm"}, (kind.rows, fmt)
            assert kind.by_name["c"].unavailable(fmt, CPU) == "the compiled kernel takes bfloat16 weights on a CPU"


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_kernel_matches_the_reference(shape, dtype):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    x = torch.randn(shape[1], dtype=dtype)
    want = torch.empty(shape[0], dtype=dtype)
    gemv_reference(x, w, want)
    names = ONE_ROW.available(_fmt(dtype), CPU)
    # The compiled kernels must be among them here: the machines this suite runs on have a compiler.
    assert {"c", "c-prefetch", "c-ahead"} <= set(names)
    for name in names:
        got = torch.full((shape[0],), float("nan"), dtype=dtype)
        ONE_ROW.by_name[name].run(x, w, got)
        # Sums in another order: within one rounding of the output dtype, relative to the terms.
        scale = (w.float().abs() @ x.float().abs()).max().item()
        tol = 2 * torch.finfo(dtype).eps * max(scale, 1.0)
        assert (got.float() - want.float()).abs().max().item() <= tol, name


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("shape", SHAPES + [(33, 64), (16, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_few_row_kernel_matches_the_reference(shape, rows, dtype):
    # Row counts around the AVX-512 tile's four and past AMX's sixteen columns, weight rows
    # around both tiles' blocks, widths that are and are not a multiple of an AMX tile's 32.
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    x = torch.randn(rows, shape[1], dtype=dtype)
    want = torch.empty(rows, shape[0], dtype=dtype)
    rows_reference(x, w, want)
    names = FEW_ROW.available(_fmt(dtype), CPU)
    assert "c" in names
    scale = max((x.float().abs() @ w.float().abs().t()).max().item(), 1.0)
    for name in names:
        got = torch.full((rows, shape[0]), float("nan"), dtype=dtype)
        FEW_ROW.by_name[name].run(x, w, got)
        assert (got.float() - want.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * scale, name


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "not-invariant"])
def test_a_bound_projection_runs_the_kernel_chosen_for_each_row_count(invariant):
    # One-row c; few-row choices made for 2 and 8 rows (c for 2, mm for 8, and the 8-row one not
    # covering the other shape); the many-row GEMM past them. Batch-invariant, rows whose few-row
    # kernel does not sum in the one-row kernel's order run the few-row form of the one-row
    # choice where its kind has one (c), else the one-row kernel each (mv).
    w, other = torch.randn(12, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    kernels = KernelSet([
        Choice(ONE_ROW, "bfloat16", "forced", {(12, 32): "c"}),
        Choice(FEW_ROW, "bfloat16", "forced", {(12, 32): "c", (16, 32): "c"}, rows=2),
        Choice(FEW_ROW, "bfloat16", "forced", {(12, 32): "mm"}, rows=8),
    ], env={"POCKETLLM_BATCH_INVARIANT": "1" if invariant else "0"})
    bound = kernels.bind(w)
    past = "c" if invariant else "mm"
    assert bound.names == {"one-row": "c", "2-row": "c"} | {f"{r}-row": past for r in range(3, 9)} | {"many-row": "mm"}
    # A shape no one-row choice covers runs the kind's default; 3..8 rows of it are past the
    # only few-row choice that covers it, so they take the many-row GEMM (or the one-row kernel
    # each; its 2 rows too, as c does not sum in mv's order).
    names = kernels.bind(other).names
    assert names["one-row"] == "mv" and names["3-row"] == ("mv per row" if invariant else "mm")
    assert names["2-row"] == ("mv per row" if invariant else "c")
    for rows in (1, 2, 3, 8, 9, 40):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        want = x.float() @ w.float().t()
        for got in (bound(x), bound.alone(x), bound.many(x)):
            assert got.shape == (rows, 12) and (got.float() - want).abs().max().item() <= 0.05 * want.abs().max().item()
        if invariant:
            # Each row alone, whatever the count: the one-row kernel's bits.
            assert torch.equal(bound.alone(x), torch.cat([bound(x[i : i + 1]) for i in range(rows)]))
    # What rank 0 prints and bench --json records is what runs, not the choice set aside.
    lines = kernels.describe()
    runs = {doc["rows"]: doc["runs"] for doc in kernels.to_json() if doc["kind"] == "few-row"}
    if invariant:
        assert lines[1].endswith("; batch-invariant, what runs instead: 16x32 mv per row") and runs[2] == {"12x32": "c", "16x32": "mv per row"}
        assert lines[2].endswith("; batch-invariant, what runs instead: 12x32 c") and runs[8] == {"12x32": "c"}
    else:
        assert not any("instead" in line for line in lines) and runs == {2: {"12x32": "c", "16x32": "c"}, 8: {"12x32": "mm"}}


def test_a_forced_few_row_kernel_that_sums_by_the_call_needs_invariance_off():
    # mm's rows may round by the call's shape: forcing it would make a request's tokens depend on
    # what is batched with it, so it is refused unless the run opts out of batch invariance.
    with pytest.raises(UsageError, match="POCKETLLM_KERNELS=few-row=mm: .* set POCKETLLM_BATCH_INVARIANT=0"):
        check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "few-row=mm"})
    check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "few-row=mm", "POCKETLLM_BATCH_INVARIANT": "0"})


@pytest.mark.parametrize("isa", compiled.ISA_FLAGS)
def test_few_rows_equal_one_row_bit_for_bit_on_every_path(isa):
    # What lets the batch-invariant engine run a decode step of several sequences through the
    # few-row kernel: each row's output is exactly the one-row kernel's, at every row count,
    # with or without either prefetch, at widths that end mid-vector and weight rows past the tiles.
    lib, why = compiled.load(gemv.SOURCE, compiled.FLAGS + compiled.ISA_FLAGS[isa])
    assert lib is not None, why
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gemv_bf16.argtypes, lib.gemm_rows_bf16.argtypes = [p, p, p, i64, i64, i64, i64], [p, p, p, i64, i64, i64, i64, i64]
    lib.gemv_bf16_group.argtypes = [p, p, p, i64, i64, i64, i64]
    lib.gemm_rows_next_bf16.argtypes = [p, p, p, i64, i64, i64, i64, i64]
    lib.gemm_rows_wide_bf16.argtypes, lib.gemm_rows_wide_bf16.restype = [p, p, p, i64, i64, i64, i64, i64], ctypes.c_int
    lib.gemm_rows_blocked_bf16.argtypes, lib.gemm_rows_blocked_bf16.restype = [p, p, p, i64, i64, i64, i64, i64], ctypes.c_int
    lib.gemv_bf16_isa.restype = ctypes.c_char_p
    lib_isa = lib.gemv_bf16_isa().decode()
    # The grouped one-row form is the AVX2 build's (there one row alone waits on its FMA chain).
    assert (lib.gemv_bf16_group_rows() > 1) == (lib_isa == "avx2"), lib_isa
    torch.manual_seed(1)
    # Random rows rarely show a different order after the bf16 rounding; rows whose sum cancels
    # 2^24 against -2^24 in one vector lane, beside a 1 in the next element, always do.
    cancel = torch.randn(9, 67)
    cancel[:, 0], cancel[:, 1], cancel[:, 32] = 2.0**24, 1.0, -(2.0**24)
    # 300 x 1000: several blocks of weight rows per thread for the blocked form.
    cases = [(torch.randn(out_f, n), torch.randn(16, n)) for out_f, n in ((13, 1000), (64, 256), (7, 33), (300, 1000))] + [(cancel, torch.ones(16, 67))]
    for w, x in cases:
        (out_f, n), w, x = w.shape, w.bfloat16(), x.bfloat16()
        for prefetch, ahead in ((0, 0), (gemv.PREFETCH_BYTES, 0), (0, gemv.AHEAD_BYTES)):
            singles = torch.empty(16, out_f, dtype=torch.bfloat16)
            for r in range(16):
                lib.gemv_bf16(w.data_ptr(), x[r].data_ptr(), singles[r].data_ptr(), out_f, n, prefetch, ahead)
            want = torch.empty(16, out_f, dtype=torch.bfloat16)
            rows_reference(x, w, want)
            terms = x.float().abs() @ w.float().abs().t()
            assert bool(((singles.float() - want.float()).abs() <= 2**-7 * terms).all()), isa
            # The four-rows-at-a-time one-row form (AVX2; elsewhere the same entry as one row).
            grouped = torch.full((16, out_f), float("nan"), dtype=torch.bfloat16)
            for r in range(16):
                lib.gemv_bf16_group(w.data_ptr(), x[r].data_ptr(), grouped[r].data_ptr(), out_f, n, prefetch, ahead)
            assert torch.equal(grouped, singles), f"{isa} {out_f}x{n}: four weight rows at a time differ from one at a time"
            for m in range(2, 17):
                batch = torch.empty(m, out_f, dtype=torch.bfloat16)
                lib.gemm_rows_bf16(w.data_ptr(), x.data_ptr(), batch.data_ptr(), out_f, n, m, prefetch, ahead)
                assert torch.equal(batch, singles[:m]), f"{isa} {out_f}x{n}: {m} rows differ from one row at a time"
                lib.gemm_rows_next_bf16(w.data_ptr(), x.data_ptr(), batch.data_ptr(), out_f, n, m, prefetch, ahead)
                assert torch.equal(batch, singles[:m]), f"{isa} {out_f}x{n}: {m} rows with the next block's prefetch differ from one row at a time"
                for wrows in (1, 2):
                    wide = torch.full((m, out_f), float("nan"), dtype=torch.bfloat16)
                    # Built where the tile is (the AVX-512 paths); elsewhere it says so and writes nothing.
                    built = lib.gemm_rows_wide_bf16(w.data_ptr(), x.data_ptr(), wide.data_ptr(), out_f, n, m, wrows, ahead)
                    assert bool(built) == (wrows in gemv.WIDE_ROWS.get(lib_isa, ())), f"{isa} ({lib_isa}): wide tile of {wrows} rows built: {built}"
                    if built:
                        assert torch.equal(wide, singles[:m]), f"{isa} {out_f}x{n}: wide tile of {wrows} at {m} rows differs from one row at a time"
                # The blocked form (AVX2, AVX-512 without BF16), its blocks as the kernel takes them
                # and the smallest, so sums cross many blocks of inputs and rows many blocks.
                for x_bytes, block_rows in ((gemv.BLOCKED_X_BYTES, gemv.BLOCKED_ROWS), (1, 1), (1, 5)):
                    blocked = torch.full((m, out_f), float("nan"), dtype=torch.bfloat16)
                    built = lib.gemm_rows_blocked_bf16(w.data_ptr(), x.data_ptr(), blocked.data_ptr(), out_f, n, m, x_bytes, block_rows)
                    assert built == (1 if lib_isa in gemv.BLOCKED_BUILDS else 0), f"{isa} ({lib_isa}): blocked form returned {built}"
                    if built:
                        assert torch.equal(blocked, singles[:m]), f"{isa} {out_f}x{n}: blocked at {m} rows, blocks of {x_bytes} x bytes and {block_rows} rows, differs from one row at a time"


def built_somewhere(candidate, monkeypatch) -> None:
    """Use the widest build of the compiled kernels (POCKETLLM_ISA, as narrow as this CPU's own
    down to scalar) that has `candidate` (some forms are built only for some ISAs, c-group and
    c-blocked for AVX2 say); skip where none has it, or where what lacks is not the build's."""
    why = candidate.unavailable("bfloat16", CPU)
    for isa in list(compiled.ISA_FLAGS)[1:]:
        if not why or " build" not in why:
            break
        monkeypatch.setenv(compiled.ENV_ISA, isa)
        why = candidate.unavailable("bfloat16", CPU)
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("name", ["c", "c-prefetch", "c-ahead", "c-group"])
def test_the_compiled_gemv_refuses_bad_arguments(name, monkeypatch):
    built_somewhere(ONE_ROW.by_name[name], monkeypatch)
    run = ONE_ROW.by_name[name].run
    symbol = "gemv_bf16_group" if name == "c-group" else "gemv_bf16"
    w, x, out = torch.randn(12, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16), torch.empty(12, dtype=torch.bfloat16)
    run(x, w, out)
    with pytest.raises(ValueError, match=rf"{symbol}: x must be bfloat16, got float32"):
        run(x.float(), w, out)
    with pytest.raises(ValueError, match=rf"{symbol}: x has shape \(31,\) \(31 elements\) where 32 are needed"):
        run(x[:31], w, out)
    with pytest.raises(ValueError, match=rf"{symbol}: out has shape \(11,\)"):
        run(x, w, out[:11])
    with pytest.raises(ValueError, match=rf"{symbol}: w must be contiguous"):
        run(x, torch.randn(32, 12, dtype=torch.bfloat16).t(), out)
    with pytest.raises(ValueError, match=rf"{symbol}: w must have 2 dimensions"):
        run(x, w.reshape(-1), out)
    # A strided x is copied, not refused: it is only read.
    strided = torch.randn(64, dtype=torch.bfloat16)[::2]
    run(strided, w, out)
    torch.testing.assert_close(out.float(), w.float() @ strided.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("name", ["c", "c-prefetch", "c-ahead", "c-next", "c-wide", "c-wide2", "c-blocked", "amx"])
def test_the_compiled_few_row_kernels_refuse_bad_arguments(name, monkeypatch):
    built_somewhere(FEW_ROW.by_name[name], monkeypatch)
    run = FEW_ROW.by_name[name].run
    w, x, out = torch.randn(12, 32, dtype=torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16), torch.empty(3, 12, dtype=torch.bfloat16)
    run(x, w, out)
    with pytest.raises(ValueError, match=r": out has shape \(2, 12\) \(24 elements\) where 36 are needed"):
        run(x, w, out[:2])
    with pytest.raises(ValueError, match=r": w must be bfloat16, got float16"):
        run(x, w.half(), out)
    with pytest.raises(ValueError, match=r": x has shape \(3, 31\)"):
        run(x[:, :31], w, out)


def test_without_a_compiler_the_compiled_kernel_is_left_out(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(compiled, "_loaded", {})
    from pocketllm.ops.gemv import kernels

    monkeypatch.setattr(kernels, "_c_gemv", None)
    assert "c" not in ONE_ROW.available("bfloat16", CPU)
    assert "no C compiler" in ONE_ROW.by_name["c"].unavailable("bfloat16", CPU)
    with pytest.raises(UsageError, match="POCKETLLM_KERNELS=one-row=c: no C compiler"):
        check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "one-row=c"})
    from pocketllm.ops.fused import decode_ops

    ops = decode_ops(torch.bfloat16, torch.device("cpu"))
    assert not ops.compiled and "no C compiler" in ops.describe()
    chosen = KernelSet.choose([torch.randn(8, 8, dtype=torch.bfloat16)], env={})
    assert chosen.choices[0].how.split(",")[0] in ("measured", "cached") and "c" not in chosen.choices[0].seconds[(8, 8)]

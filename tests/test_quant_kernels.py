"""The quantized projection kernels against layout.quant_linear_reference: every candidate of every
row class at odd shapes (outputs not a multiple of any tile, inputs a multiple of the group only),
every scheme, group, symmetry and scale dtype; the compiled few-row kernels' rows equal the
one-row kernel's bit for bit, on each instruction-set path this CPU can run (AVX-512 BF16,
AVX-512F, AVX2, plain C); the wrappers refuse what they cannot read."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pocketllm import compiled
from pocketllm.ops.quant import candidates as qc
from pocketllm.ops.quant import native
from pocketllm.ops.quant.layout import QuantizedWeight, dequantize, quant_linear_int8x_reference, quant_linear_reference, quantize, quantize_x_int8

FORMATS = ["int8", "int4-g32", "int4-g32-asym", "int4-g64", "int4-g64-asym", "int4-g128", "int4-g128-asym"]
# Inputs per format: a multiple of the group that is not a multiple of the AVX-512 int4 step (128
# inputs), and one that is; int8 ends mid-vector.
WIDTHS = {32: (96, 256), 64: (192, 320), 128: (384, 640), None: (101, 96)}
# Around the compiled tile's four x rows and up to the few-row class's sixteen; the bit-for-bit
# test below runs every count from 2 to 16 against the one-row kernel.
ROWS = {qc.ONE: [1], qc.FEW: [5, 16], qc.MANY: [17]}
VARIANTS = list(compiled.ISA_FLAGS)
INT8X_VARIANTS = [v for v in VARIANTS if v != "avx512f"]


@pytest.fixture(scope="module", autouse=True)
def built():
    """Every library and instruction-set variant, built side by side (each is a compiler run)."""
    # dequant.c is plain C the compiler vectorizes: only its native build runs. The int8-x source
    # has no path that tells AVX-512 BF16 from AVX-512F: those two builds are one.
    jobs = [
        (name, isa) for name in native.SOURCES
        for isa in {"dequant": ["native"], "int4-int8x": INT8X_VARIANTS, "int8-int8x": INT8X_VARIANTS, "int8x-many": INT8X_VARIANTS}.get(name, VARIANTS)
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: native.library(*job), jobs))
    for (name, isa), (lib, why) in zip(jobs, results):
        assert lib is not None, f"{name} ({isa}): {why}"


def weight(fmt: str, out: int, cols: int, scale_dtype=torch.bfloat16, seed=0) -> QuantizedWeight:
    scheme, group, symmetric = qc.parse_format(fmt)
    torch.manual_seed(seed)
    return quantize(torch.randn(out, cols), scheme, group, symmetric, scale_dtype)


def check(got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, tight: bool, label: str, rounds_x: bool = False) -> None:
    """got against the reference (rounds_x: the one that rounds x to int8 first). Summed in fp32
    and rounded once (tight): within half a bf16 step of the reference plus fp32's error on the
    terms; with weights or scales rounded to bf16 on the way: within two bf16 steps of the terms'
    size."""
    want = torch.empty(got.shape, dtype=torch.float32)
    (quant_linear_int8x_reference if rounds_x else quant_linear_reference)(x, qw, want)
    terms = x.float().abs() @ dequantize(qw).abs().t()
    err = (got.float() - want).abs()
    bound = (2**-8 * want.abs() + 2**-16 * terms) if tight else 2 * 2**-7 * terms.clamp_min(1.0)
    assert bool((err <= bound).all()), f"{label}: worst error {(err - bound).max().item():.3g} over its bound"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("row_class", [qc.ONE, qc.FEW, qc.MANY])
def test_every_candidate_matches_the_reference(fmt, row_class):
    names = [c.name for c in qc.available(row_class, fmt)]
    tiles = {"c", "c-prefetch", "c-prefetch-far", "c-ahead", "c-l2"}
    expected = {qc.ONE: set(tiles), qc.FEW: set(tiles), qc.MANY: {"dequant-bf16", "dequant-f32"}}[row_class]
    expected |= {"int8pack"} if fmt == "int8" else {"int4pack"}
    scheme = qc.parse_format(fmt)[0]
    if row_class != qc.MANY and not fmt.endswith("asym") and not native.int8x_unavailable(scheme=scheme):
        expected |= {"c-int8x"} | ({"c-int8x-l2"} if scheme == "int4" else set())
    if row_class == qc.FEW and fmt == "int8" and not native.int8x_form_unavailable("four"):
        expected |= {"c-int8x-4"}
    if row_class == qc.FEW and fmt == "int8" and not native.int8x_form_unavailable("blocked"):
        expected |= {"c-int8x-blocked"}
    if row_class == qc.MANY and not native.int8x_many_unavailable():
        expected |= {"c-int8x-gemm"}
    assert set(names) == expected
    group = qc.parse_format(fmt)[1]
    narrow, wide = WIDTHS[group]
    for cols, scale_dtype in ((narrow, torch.bfloat16), (wide, torch.float16), (narrow, torch.float32)):
        qw = weight(fmt, 37, cols, scale_dtype)
        for cand in qc.available(row_class, fmt):
            if cand.name == "int8pack" and cols % 16:
                with pytest.raises(ValueError, match="needs a multiple of 16 inputs"):
                    cand.prepare(qw)
                continue
            prepared = cand.prepare(qw) if cand.prepare else qw
            for rows in ROWS[row_class]:
                x = torch.randn(cols, dtype=torch.bfloat16) if rows == 1 else torch.randn(rows, cols, dtype=torch.bfloat16)
                got = torch.full((*x.shape[:-1], 37), float("nan"), dtype=torch.bfloat16)
                cand.run(x, prepared, got)
                # Exact products in fp32: the compiled GEMVs and the fp32 dequantization.
                tight = cand.name in (*tiles, "c-int8x", "c-int8x-l2", "c-int8x-gemm", "dequant-f32") or (cand.name == "int8pack" and scale_dtype == torch.bfloat16)
                check(got, x, qw, tight, f"{cand.name} {fmt} {cols} inputs, {scale_dtype} scales, {rows} rows", cand.rounds_x)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_few_rows_equal_one_row_bit_for_bit_on_every_path(fmt, variant):
    group = qc.parse_format(fmt)[1]
    cols = WIDTHS[group][0]
    qw = weight(fmt, 13, cols)
    x = torch.randn(16, cols, dtype=torch.bfloat16)
    for prefetch, where in qc.GEMV_PREFETCH.values():
        run = native.gemv(prefetch, variant, where)
        singles = torch.empty(16, 13, dtype=torch.bfloat16)
        for i in range(16):
            run(x[i].clone(), qw, singles[i])
        check(singles, x, qw, tight=True, label=f"{variant} one-row")
        for m in (2, 3, 4, 5, 8, 16):
            batch = torch.empty(m, 13, dtype=torch.bfloat16)
            run(x[:m].contiguous(), qw, batch)
            assert torch.equal(batch, singles[:m]), f"{variant} {fmt}: {m} rows differ from one row at a time"


@pytest.mark.parametrize("variant", INT8X_VARIANTS)
@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128", "int8"])
def test_int8_x_few_rows_equal_one_row_bit_for_bit(fmt, variant):
    # Where the variant's build has AVX-512 VNNI (int4) or AVX2; elsewhere (plain C) its kernel
    # refuses with the reason.
    scheme, group, _ = qc.parse_format(fmt)
    cols = WIDTHS[group][0]
    qw = weight(fmt, 13, cols)
    x = torch.randn(16, cols, dtype=torch.bfloat16)
    prefetch, where = qc.INT8X_PREFETCH["c-int8x" if scheme == "int8" else "c-int8x-l2"]
    run = native.gemv(prefetch, variant, where, int8_x=True)
    if native.int8x_unavailable(variant, scheme):
        with pytest.raises(RuntimeError, match="AVX2"):
            run(x[0], qw, torch.empty(13, dtype=torch.bfloat16))
        return
    singles = torch.empty(16, 13, dtype=torch.bfloat16)
    for i in range(16):
        run(x[i].clone(), qw, singles[i])
    check(singles, x, qw, tight=True, label=f"{variant} one-row", rounds_x=True)
    for m in (2, 3, 4, 5, 8, 16):
        batch = torch.empty(m, 13, dtype=torch.bfloat16)
        run(x[:m].contiguous(), qw, batch)
        assert torch.equal(batch, singles[:m]), f"{variant} {fmt}: {m} rows differ from one row at a time"
    if scheme == "int8":
        # Four weight rows a tile (13 rows: three whole tiles and one row) where the build has it.
        four = native.gemv(0, variant, int8_x=True, form="four")
        if native.int8x_form_unavailable("four", variant):
            with pytest.raises(RuntimeError, match="no four-row int8-x tile"):
                four(x[:2].contiguous(), qw, torch.empty(2, 13, dtype=torch.bfloat16))
            return
        for m in (1, 2, 3, 4, 5, 8, 16):
            batch = torch.empty(m, 13, dtype=torch.bfloat16)
            four(x[:m].contiguous(), qw, batch)
            assert torch.equal(batch, singles[:m]), f"{variant} {fmt}: {m} rows four weight rows a tile differ from one row at a time"


@pytest.mark.parametrize("variant", INT8X_VARIANTS)
def test_int8_x_blocked_rows_equal_one_row_bit_for_bit(variant):
    # 70 rows (two whole blocks of 32 and a part) by 2080 inputs (65 blocks of 32: an odd last
    # block), so that with eight or more x rows the sums are carried over several ranges of inputs.
    qw = weight("int8", 70, 2080)
    x = torch.randn(16, 2080, dtype=torch.bfloat16)
    blocked = native.gemv(0, variant, int8_x=True, form="blocked")
    if native.int8x_form_unavailable("blocked", variant):
        with pytest.raises(RuntimeError, match="no blocked int8-x form"):
            blocked(x[:2].contiguous(), qw, torch.empty(2, 70, dtype=torch.bfloat16))
        return
    one = native.gemv(0, variant, int8_x=True)
    singles = torch.empty(16, 70, dtype=torch.bfloat16)
    for i in range(16):
        one(x[i].clone(), qw, singles[i])
    for m in (1, 2, 3, 5, 8, 16):
        batch = torch.empty(m, 70, dtype=torch.bfloat16)
        blocked(x[:m].contiguous(), qw, batch)
        assert torch.equal(batch, singles[:m]), f"{variant}: {m} rows blocked differ from one row at a time"


@pytest.mark.parametrize("variant", INT8X_VARIANTS)
@pytest.mark.parametrize("fmt", ["int4-g32-asym", "int4-g128", "int8"])
def test_int8_x_gemm_rows_do_not_depend_on_the_pass(fmt, variant):
    # A prompt's rows must come out the same whichever pass they are read in: each row alone, and
    # at every offset of calls of 2..19 rows (around the tile's four x rows and the weight's
    # eight-row groups: 21 weight rows end mid-group), equals the 19-row call bit for bit.
    scheme, group, _ = qc.parse_format(fmt)
    cols = WIDTHS[group][1]
    qw = weight(fmt, 21, cols)
    x = torch.randn(19, cols, dtype=torch.bfloat16)
    run = native.gemv(0, variant, many=True)
    if native.int8x_many_unavailable(variant):
        with pytest.raises(RuntimeError, match="AVX2"):
            run(x, qw, torch.empty(19, 21, dtype=torch.bfloat16))
        return
    whole = torch.empty(19, 21, dtype=torch.bfloat16)
    run(x, qw, whole)
    check(whole, x, qw, tight=True, label=f"{variant} {fmt}", rounds_x=True)
    for m in (1, 2, 3, 5, 8, 11):
        for c0 in range(0, 19 - m + 1, 3):
            part = torch.empty(m, 21, dtype=torch.bfloat16)
            run(x[c0 : c0 + m].contiguous(), qw, part)
            assert torch.equal(part, whole[c0 : c0 + m]), f"{variant} {fmt}: rows {c0}:{c0 + m} differ from the whole call's"


def test_int8_x_rounding_is_the_references():
    # An outlier makes its block coarse and no other; a zero block stays zero; x at a block's
    # largest value is exactly 127 steps.
    x = torch.randn(2, 96).bfloat16()
    x[0, 3], x[1, 32:64] = 50.0, 0.0
    xq = quantize_x_int8(x)
    for r, b in ((0, 0), (0, 1), (1, 0), (1, 2)):
        block, got = x[r, 32 * b : 32 * b + 32].float(), xq[r, 32 * b : 32 * b + 32]
        step = block.abs().max() / 127
        assert torch.all((got - block).abs() <= step / 2 + 1e-6)
    assert torch.equal(xq[1, 32:64], torch.zeros(32))
    assert xq[0, 3].item() == pytest.approx(50.0)
    with pytest.raises(ValueError, match="symmetric int4"):
        native.gemv(0, int8_x=True)(x[0], weight("int4-g32-asym", 5, 96), torch.empty(5, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", ["int8", "int4-g64-asym"])
def test_fp32_activations_run_every_candidate(fmt):
    # An fp32 run's activations: the compiled GEMVs take them through fp32 blocks of the weight.
    qw = weight(fmt, 21, 320, torch.float32)
    for row_class, rows in ((qc.ONE, 1), (qc.FEW, 3), (qc.MANY, 17)):
        for cand in qc.available(row_class, fmt):
            x = torch.randn(320) if rows == 1 else torch.randn(rows, 320)
            got = torch.full((*x.shape[:-1], 21), float("nan"))
            cand.run(x, cand.prepare(qw), got)
            want = torch.empty_like(got)
            quant_linear_reference(x, qw, want)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), f"{cand.name} {row_class}"


def test_the_blocked_product_covers_every_row(monkeypatch):
    # Blocks of 16 rows: 37 rows end on a shorter block.
    monkeypatch.setattr(native, "BLOCK_BYTES", 0)
    monkeypatch.setattr(native, "MIN_BLOCK_ROWS", 16)
    qw = weight("int4-g32-asym", 37, 96)
    x = torch.randn(17, 96, dtype=torch.bfloat16)
    for cand in qc.MANY_ROW[:2]:
        got = torch.full((17, 37), float("nan"), dtype=torch.bfloat16)
        cand.run(x, qw, got)
        check(got, x, qw, tight=cand.name == "dequant-f32", label=cand.name)


def test_a_prepared_weight_gives_what_the_weight_gives():
    qw = weight("int4-g64-asym", 21, 320)
    x = torch.randn(3, 320, dtype=torch.bfloat16)
    for cand in qc.FEW_ROW + qc.MANY_ROW:
        if cand.unavailable("int4-g64-asym", torch.device("cpu")):
            continue
        a, b = torch.empty(3, 21, dtype=torch.bfloat16), torch.empty(3, 21, dtype=torch.bfloat16)
        cand.run(x, qw, a)
        cand.run(x, cand.prepare(qw), b)
        assert torch.equal(a, b), cand.name


def test_a_dequantized_block_is_the_reference_weight():
    for fmt in ("int8", "int4-g32-asym", "int4-g128"):
        qw = weight(fmt, 10, 256, torch.float16)
        block = torch.empty(4, 256)
        native.dequantize_rows(qw, 3, 7, block)
        assert torch.equal(block, dequantize(qw)[3:7])
        half = torch.empty(4, 256, dtype=torch.bfloat16)
        native.dequantize_rows(qw, 3, 7, half)
        assert torch.equal(half, dequantize(qw)[3:7].to(torch.bfloat16))


def test_the_wrappers_refuse_what_they_cannot_read():
    run = qc.ONE_ROW[0].run
    qw = weight("int4-g32", 8, 64)
    x, out = torch.randn(64, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    cases = [
        ((x.float(), qw, out), "out must be float32"),
        ((x.to(torch.int32), qw, out), "x must be bfloat16, float16 or float32"),
        ((x[:32], qw, out), r"x must have shape \(64,\)"),
        ((x, qw, out[:4]), r"out must have shape \(8,\)"),
        ((torch.randn(2, 128, dtype=torch.bfloat16)[:, ::2], qw, torch.empty(2, 8, dtype=torch.bfloat16)), "x must be contiguous"),
        ((x, qw, torch.empty(2, 8, dtype=torch.bfloat16)), "out must have shape"),
        ((torch.empty(0, 64, dtype=torch.bfloat16), qw, torch.empty(0, 8, dtype=torch.bfloat16)), "rows >= 1"),
        ((x, QuantizedWeight("int4", 32, qw.qweight, qw.scales.to(torch.int32)), out), "scales must be bfloat16, float16 or float32"),
        ((x, QuantizedWeight("int4", 32, qw.qweight.t().contiguous().t(), qw.scales), out), "qweight must be contiguous"),
        ((x, QuantizedWeight("int4", 32, qw.qweight, qw.scales[:4]), out), r"scales must have shape \(8, 2\)"),
        ((x, QuantizedWeight("int4", 32, qw.qweight, qw.scales, torch.zeros(8, 2, dtype=torch.int8)), out), "zeros must be uint8"),
        ((x, QuantizedWeight("int4", 16, qw.qweight, qw.scales), out), "group 16 is not 32 or a multiple of 64"),
        ((x, QuantizedWeight("int8", 32, qw.qweight, qw.scales[:, :1]), torch.empty(8, dtype=torch.bfloat16)), "qweight must be int8"),
        ((x, torch.randn(8, 64), out), "must be a QuantizedWeight"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            run(*args)
    with pytest.raises(ValueError, match="rows 6:9 are not within 0:8"):
        native.dequantize_rows(qw, 6, 9, torch.empty(3, 64))
    with pytest.raises(ValueError, match="block must be bfloat16 or float32"):
        native.dequantize_rows(qw, 0, 2, torch.empty(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="do not fit a weight of 8x64"):
        qc.MANY_ROW[-1].run(torch.randn(3, 32), qw, torch.empty(3, 8))


def test_formats_and_the_candidates_table():
    assert qc.parse_format("int4-g64-asym") == ("int4", 64, False)
    assert qc.parse_format("int8") == ("int8", None, True)
    assert qc.parse_format("bfloat16") is None and qc.parse_format("int4-gx") is None
    assert "take int8 or int4 weights" in qc.ONE_ROW[0].unavailable("bfloat16", torch.device("cpu"))
    assert "groups of 32 or a multiple of 64" in qc.ONE_ROW[0].unavailable("int4-g96", torch.device("cpu"))
    assert "int8 weights" in next(c for c in qc.ONE_ROW if c.name == "int8pack").unavailable("int4-g32", torch.device("cpu"))
    assert qc.table().count("\n") == len(qc.ONE_ROW + qc.FEW_ROW + qc.MANY_ROW) + 1

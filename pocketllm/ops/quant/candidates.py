"""Every quantized projection kernel, by row class, as the kernel registry takes candidates.

Each candidate runs `run(x, w, out)`: x [in] (one row) or [m, in], out [out] or [m, out], both
bf16, fp16 or fp32 (the compiled GEMVs take bf16 in C, the others through fp32 blocks), w
what its `prepare` made of a QuantizedWeight (or the QuantizedWeight itself, prepared on the
spot). `unavailable(weight_format, device)` says why it cannot run weights of that format there
("" when it can); formats are "int8", "int4-g<group>" and "int4-g<group>-asym". Candidates with
the same `layout` share one prepared form. The reference every one must equal up to summation
order (and the roundings their notes state) is layout.quant_linear_reference.

| name | rows | what |
|---|---|---|
| c, c-prefetch, c-prefetch-far, c-ahead, c-l2 | one, few | compiled int8/int4 GEMV tiles (gemv_int4.c, gemv_int8.c) |
| c-int8x, c-int8x-l2 | one, few | int8 or symmetric int4 against x rounded to int8 (gemv_int8_int8x.c, gemv_int4_int8x.c): equals layout.quant_linear_int8x_reference instead |
| c-int8x-4 | few | int8 c-int8x four weight rows a tile (AVX-512 VNNI), the same bits |
| c-int8x-blocked | few | int8 c-int8x blocked for the caches (AVX2), the same bits |
| int8pack | one, few, many | torch._weight_int8pack_mm |
| int4pack | one, few, many | aten._weight_int4pack_mm_for_cpu on torch's packed layout |
| dequant-bf16, dequant-f32 | many | blocks dequantized (dequant.c) into torch's GEMM |
| c-int8x-gemm | many | int8 or int4 against x rounded to int8, eight weight rows a vector (gemm_int8x.c): equals layout.quant_linear_int8x_reference |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pocketllm.ops.quant import dequant_mm, native, torch_ops

ONE, FEW, MANY = "one-row", "few-row", "many-row"
# How far ahead of each weight load c-prefetch and c-prefetch-far ask for it: at least this many
# bytes, as whole tiles (the same place in a later tile of rows). Without a software prefetch the
# kernels streamed far below the memory's rate: the hardware prefetcher did little for them
# (docs/measuring.md, figures behind the code's choices). The best distance depends on the
# machine's memory latency and the rows' length, so two are candidates and the registry measures
# them (docs/quantization.md).
PREFETCH_BYTES = 8192
PREFETCH_FAR_BYTES = 32768
# Each compiled GEMV candidate's prefetch: (distance in bytes, where the lines go), as native.gemv
# takes them. Into L2 but not L1 (c-l2) streamed a tile of four short rows ~1.4x faster than into
# L1 on an AMD Zen 4, and no faster elsewhere: measured, as the others are.
GEMV_PREFETCH = {
    "c": (0, native.NON_TEMPORAL),
    "c-prefetch": (PREFETCH_BYTES, native.NON_TEMPORAL),
    "c-prefetch-far": (PREFETCH_FAR_BYTES, native.NON_TEMPORAL),
    "c-ahead": (PREFETCH_BYTES, native.ALL_LEVELS),
    "c-l2": (PREFETCH_BYTES, native.L2),
}


@dataclass(frozen=True)
class QuantCandidate:
    name: str
    rows: str  # ONE, FEW or MANY
    run: Callable[[torch.Tensor, object, torch.Tensor], None]
    what: str
    formats: str  # the weight formats it takes, in words
    unavailable: Callable[[str, torch.device], str]
    prepare: Callable[[object], object] | None = None
    layout: str = ""
    sources: tuple = ()  # compiled sources a measured choice depends on
    # True: it rounds bf16 x to int8 first (layout.quantize_x_int8), so its reference is
    # layout.quant_linear_int8x_reference and its rows' bits are not the other tiles'.
    rounds_x: bool = False
    # A compiled kernel: the same kernel built for another of native.library's instruction-set
    # variants (for benchmarks and tests on one machine), None where that build lacks it.
    built_for: Callable[[str], Callable | None] | None = None


def parse_format(fmt: str) -> tuple[str, int | None, bool] | None:
    """"int8" -> ("int8", None, True); "int4-g64-asym" -> ("int4", 64, False); None otherwise."""
    if fmt == "int8":
        return "int8", None, True
    parts = fmt.split("-")
    if parts[0] != "int4" or len(parts) not in (2, 3) or not parts[1].startswith("g") or not parts[1][1:].isdigit():
        return None
    if len(parts) == 3 and parts[2] != "asym":
        return None
    return "int4", int(parts[1][1:]), len(parts) == 2


def _compiled_unavailable(part: str):
    """part "gemv": the scheme's GEMV library; "dequant": dequant.c; "int8x": the scheme's int8-x
    kernel (int8, or symmetric int4); "many": the many-row int8-x GEMM (gemm_int8x.c)."""

    def why(fmt: str, device: torch.device) -> str:
        parsed = parse_format(fmt)
        if parsed is None:
            return "the compiled quantized kernels take int8 or int4 weights"
        if device.type != "cpu":
            return "the compiled quantized kernels run on a CPU"
        scheme, group, symmetric = parsed
        if part == "int8x" and not symmetric:
            return "c-int8x takes int8 or symmetric int4 weights"
        if scheme == "int4" and not native.int4_group_ok(group):
            return f"the compiled int4 kernels take groups of 32 or a multiple of 64, not {group}"
        if part == "int8x":
            return native.unavailable(f"{scheme}-int8x") or native.int8x_unavailable(scheme=scheme)
        if part == "many":
            return native.int8x_many_unavailable()
        return native.unavailable(scheme if part == "gemv" else "dequant")

    return why


def _torch_unavailable(scheme: str):
    def why(fmt: str, device: torch.device) -> str:
        parsed = parse_format(fmt)
        if parsed is None or parsed[0] != scheme:
            return f"torch's {scheme} op takes {scheme} weights"
        return "" if device.type == "cpu" else f"torch's {scheme} op here is its CPU kernel"

    return why


_GEMV_SOURCES = (native.SOURCES["int4"], native.SOURCES["int8"])
_DEQUANT_SOURCES = (native.SOURCES["dequant"],)
_ALL = "int8; int4 g32 or a multiple of 64, symmetric or asymmetric; scales bf16/fp16/fp32 as stored"
_INT8PACK = "int8; scales used in x's dtype (fp16/fp32 scales rounded for bf16 x)"
_INT4PACK = "int4, any group; scales and zero offsets (8 - z) * scale used in x's dtype (rounded for bf16 x)"


def _gemv(name: str, rows: str, what: str) -> QuantCandidate:
    prefetch, where = GEMV_PREFETCH[name]
    return QuantCandidate(
        name, rows, native.gemv(prefetch, where=where), what, _ALL, _compiled_unavailable("gemv"), native.prepare, "checked",
        _GEMV_SOURCES, built_for=lambda isa: native.gemv(prefetch, isa, where),
    )


# How far ahead c-int8x asks for each weight load and where the lines go: into every cache level
# (as c-ahead), or into L2 (c-int8x-l2, as c-l2). int8's int8-x kernel reads one weight row at a
# time and prefetches nothing, so c-int8x-l2 is int4's alone.
INT8X_PREFETCH = {"c-int8x": (PREFETCH_BYTES, native.ALL_LEVELS), "c-int8x-l2": (PREFETCH_BYTES, native.L2)}
# The candidates that differ from another only in where or how far they prefetch: their sums are
# c's or c-int8x's.
PREFETCH_ONLY = (set(GEMV_PREFETCH) - {"c"}) | (set(INT8X_PREFETCH) - {"c-int8x"})


def _int8x(rows: str, name: str, what: str, unavailable) -> QuantCandidate:
    prefetch, where = INT8X_PREFETCH[name]
    return QuantCandidate(
        name, rows, native.gemv(prefetch, where=where, int8_x=True), what, "int8; int4 symmetric, g32 or a multiple of 64; x rounded to int8",
        unavailable, native.prepare, "checked", (native.SOURCES["int4-int8x"], native.SOURCES["int8-int8x"]), rounds_x=True,
        built_for=lambda isa: native.gemv(prefetch, isa, where, int8_x=True),
    )


_INT8X_WHAT = (
    "int8 or symmetric int4 against each x row rounded to int8 per 32 inputs, integer dot products: AVX2 "
    "(ops/quant/gemv_int8_int8x.c), AVX-512 VNNI or AVX2 for int4 (gemv_int4_int8x.c)"
)


def _int8x_int4_only(fmt: str, device: torch.device) -> str:
    return _compiled_unavailable("int8x")(fmt, device) or ("" if fmt.startswith("int4") else "c-int8x-l2 is c-int8x for int4 weights: int8's prefetches nothing")


def _int8x_pair(rows: str) -> tuple[QuantCandidate, QuantCandidate]:
    return (
        _int8x(rows, "c-int8x", _INT8X_WHAT, _compiled_unavailable("int8x")),
        _int8x(rows, "c-int8x-l2", "int4 c-int8x, each weight load prefetched into L2, not L1", _int8x_int4_only),
    )


def _int8x_form(name: str, form: str, what: str) -> QuantCandidate:
    """int8's c-int8x few-row kernel in another form ("four" or "blocked"): the same bits, on the
    builds that have it."""
    def unavailable(fmt: str, device: torch.device) -> str:
        why = _compiled_unavailable("int8x")(fmt, device)
        if why:
            return why
        return f"{name} takes int8 weights" if fmt != "int8" else native.int8x_form_unavailable(form)

    return QuantCandidate(
        name, FEW, native.gemv(0, int8_x=True, form=form), what, "int8; x rounded to int8", unavailable, native.prepare, "checked",
        (native.SOURCES["int8-int8x"],), rounds_x=True,
        built_for=lambda isa: None if native.int8x_form_unavailable(form, isa) else native.gemv(0, isa, int8_x=True, form=form),
    )


# Four weight rows at a time: each x load then serves four rows, which pays where a step's x rows
# outgrow L1 (wide layers) and costs where they do not.
_INT8X_FOUR = _int8x_form(
    "c-int8x-4", "four", "c-int8x four int8 weight rows at a time against up to four x rows (AVX-512 VNNI, ops/quant/gemv_int8_int8x.c)"
)
# Blocked for the caches (AVX2, which has no four-row tile): rows in blocks against x a block of
# inputs at a time, so wide layers' x rows stay in L1.
_INT8X_BLOCKED = _int8x_form(
    "c-int8x-blocked", "blocked",
    "c-int8x with each thread's int8 weight rows in blocks against x a block of inputs at a time, sums carried (AVX2, ops/quant/gemv_int8_int8x.c)",
)


# A prefill's GEMM with x rounded to int8 as c-int8x rounds it: the GEMV tiles' per-row scale work
# is shared by a vector's worth of weight rows here, and a weight load by four x rows (gemm_int8x.c).
_INT8X_GEMM = QuantCandidate(
    "c-int8x-gemm", MANY, native.gemv(0, many=True),
    "int8 or int4 against each x row rounded to int8 per 32 inputs: eight (AVX2) or sixteen (AVX-512 VNNI) weight rows a vector, laid out per call, byte dot products (ops/quant/gemm_int8x.c)",
    "int8; int4 g32 or a multiple of 64, symmetric or asymmetric; x rounded to int8", _compiled_unavailable("many"), native.prepare, "checked",
    (native.SOURCES["int8x-many"],), rounds_x=True,
    built_for=lambda isa: None if native.int8x_many_unavailable(isa) else native.gemv(0, isa, many=True),
)


def _torch(name: str, rows: str) -> QuantCandidate:
    if name == "int8pack":
        return QuantCandidate(
            name, rows, torch_ops.int8pack_mm, "torch._weight_int8pack_mm (the int8 layout as loaded, scales in x's dtype)",
            _INT8PACK, _torch_unavailable("int8"), torch_ops.prepare_int8pack, "int8pack",
        )
    return QuantCandidate(
        name, rows, torch_ops.int4pack_mm, "aten._weight_int4pack_mm_for_cpu on torch's packed int4 layout",
        _INT4PACK, _torch_unavailable("int4"), torch_ops.prepare_int4pack, "int4pack",
    )


ONE_ROW: tuple[QuantCandidate, ...] = (
    _gemv("c", ONE, "compiled int8/int4 GEMV (ops/quant/gemv_int4.c, gemv_int8.c): AVX-512 BF16, AVX2 or plain C"),
    _gemv("c-prefetch", ONE, "the same, each weight load prefetched non-temporally PREFETCH_BYTES ahead"),
    _gemv("c-prefetch-far", ONE, "the same, PREFETCH_FAR_BYTES ahead"),
    _gemv("c-ahead", ONE, "the same, each weight load prefetched PREFETCH_BYTES ahead into every cache level"),
    _gemv("c-l2", ONE, "the same, into L2 and beyond, not L1"),
    *_int8x_pair(ONE),
    _torch("int8pack", ONE),
    _torch("int4pack", ONE),
)
FEW_ROW: tuple[QuantCandidate, ...] = (
    _gemv("c", FEW, "compiled int8/int4 tile, four weight rows against up to four x rows; each row summed as the one-row kernel sums it"),
    _gemv("c-prefetch", FEW, "the same, each weight load prefetched non-temporally PREFETCH_BYTES ahead"),
    _gemv("c-prefetch-far", FEW, "the same, PREFETCH_FAR_BYTES ahead"),
    _gemv("c-ahead", FEW, "the same, each weight load prefetched PREFETCH_BYTES ahead into every cache level"),
    _gemv("c-l2", FEW, "the same, into L2 and beyond, not L1"),
    *_int8x_pair(FEW),
    _INT8X_FOUR,
    _INT8X_BLOCKED,
    _torch("int8pack", FEW),
    _torch("int4pack", FEW),
)
MANY_ROW: tuple[QuantCandidate, ...] = (
    QuantCandidate(
        "dequant-bf16", MANY, dequant_mm.dequant_mm_bf16, "blocks of the weight (~4 MiB of bf16) dequantized to bf16 (dequant.c), torch's bf16 GEMM",
        _ALL + "; each weight rounded to bf16", _compiled_unavailable("dequant"), native.prepare, "checked", _DEQUANT_SOURCES,
    ),
    QuantCandidate(
        "dequant-f32", MANY, dequant_mm.dequant_mm_f32, "the same blocks dequantized to fp32, torch's fp32 GEMM",
        _ALL, _compiled_unavailable("dequant"), native.prepare, "checked", _DEQUANT_SOURCES,
    ),
    _INT8X_GEMM,
    _torch("int8pack", MANY),
    _torch("int4pack", MANY),
)
BY_ROWS = {ONE: ONE_ROW, FEW: FEW_ROW, MANY: MANY_ROW}


def available(rows: str, fmt: str, device: torch.device = torch.device("cpu")) -> list[QuantCandidate]:
    """The candidates of a row class that can run weights of `fmt` on `device`."""
    return [c for c in BY_ROWS[rows] if not c.unavailable(fmt, device)]


def table() -> str:
    """Every candidate as a markdown table: name, rows, what, formats, prepare, and why it cannot
    run here for each format (blank where it can)."""
    lines = ["| name | rows | what | formats | prepare | unavailable here |", "|---|---|---|---|---|---|"]
    for c in ONE_ROW + FEW_ROW + MANY_ROW:
        why = {f: c.unavailable(f, torch.device("cpu")) for f in ("int8", "int4-g32", "int4-g128-asym")}
        reasons = "; ".join(f"{f}: {r}" for f, r in why.items() if r)
        prep = c.prepare.__name__ if c.prepare else "-"
        lines.append(f"| {c.name} | {c.rows} | {c.what} | {c.formats} | {prep} | {reasons} |")
    return "\n".join(lines)

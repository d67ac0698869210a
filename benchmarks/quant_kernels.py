"""How fast each quantized projection kernel streams a decode step's weights, against the machine's
read rate and the bf16 kernel on the same shapes.

A step's worth of projection weights (the preset's layer shapes in the order a step reads them,
fused as the engine fuses them) is built per scheme, far beyond cache; one pass runs a kernel on
every weight once, x rows per call as --rows says. Candidates (and the --bf16 candidates, c-prefetch
unless given, on bf16 weights of the same shapes) are interleaved rep-major with their order reversed every other rep; GB/s is
the bytes a pass streams (values, scales, zero points) over its time, median (min..max). The read
rate is the best full fp32 sum over 1 GiB (benchmarks/common.py), before and after.

    python benchmarks/quant_kernels.py [--preset small,qwen3.8-27b] [--schemes int8,int4-g32,...]
        [--rows 1] [--reps 6] [--isa native] [--errors] [--bf16 c,c-ahead,c-prefetch]
"""

from __future__ import annotations

import sys
import time

import torch

from common import Parser, alternate, int_list, machine, positive_int, read_bandwidths_gbps, scheme_list, script, spread
from pocketllm import compiled, host_memory
from pocketllm.config import FULL
from pocketllm.ops.quant import candidates as qc
from pocketllm.ops.quant import native
from pocketllm.ops.quant.layout import QuantizedWeight, quant_linear_reference, quantize
from pocketllm.ops.registry import FEW_ROW, ONE_ROW
from pocketllm.presets import get_preset

# Layers of each preset a pass reads, in the preset's own order of kinds: the small preset's
# whole step (with its head) is 288 MiB in bf16; two 27B layers (one GDN, one attention, no head:
# its 248k rows alone are 2.5 GB in bf16) are 1.5 GB.
DEFAULT_LAYERS = {"small": None, "qwen3.8-27b": 2}


def step_shapes(preset: str, layers: int | None, head: bool) -> list[tuple[int, int]]:
    """(out, in) of every projection a decode step reads through a GEMV, in order, as the
    engine fuses them (GDN in_proj = qkv|z|b|a, attention q|k|v, MLP gate|up)."""
    cfg = get_preset(preset)
    h, kinds = cfg.hidden_size, cfg.layer_types
    if layers == 2:  # one layer of each kind
        kinds = list(dict.fromkeys(kinds))
    elif layers is not None:
        kinds = kinds[:layers]
    shapes = []
    for kind in kinds:
        if kind == FULL:
            d = cfg.head_dim
            shapes += [(2 * cfg.num_attention_heads * d + 2 * cfg.num_key_value_heads * d, h), (h, cfg.num_attention_heads * d)]
        else:
            shapes += [(cfg.conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads, h), (h, cfg.linear_value_dim)]
        shapes += [(2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return shapes + ([(cfg.vocab_size, h)] if head else [])


def _filled(shape, dtype, fill) -> torch.Tensor:
    t = host_memory.zeros(shape, dtype)
    fill(t)
    return t


def random_weight(shape: tuple[int, int], fmt: str, scale_dtype: torch.dtype) -> QuantizedWeight:
    """A quantized weight of random values (the kernels' speed does not depend on them), on huge
    pages as the engine holds its weights."""
    scheme, group, symmetric = qc.parse_format(fmt)
    out, cols = shape
    group = group or cols
    scales = (torch.rand(out, cols // group) * 0.01 + 0.001).to(scale_dtype)
    if scheme == "int8":
        q = _filled((out, cols), torch.int8, lambda t: t.copy_(torch.randint(-127, 128, (out, cols), dtype=torch.int8)))
        return QuantizedWeight("int8", cols, q, scales)
    q = _filled((out, cols // 2), torch.uint8, lambda t: t.copy_(torch.randint(0, 256, (out, cols // 2), dtype=torch.uint8)))
    zeros = None if symmetric else torch.randint(0, 16, (out, cols // group), dtype=torch.uint8)
    return QuantizedWeight("int4", group, q, scales, zeros)


def bf16_weight(shape: tuple[int, int]) -> torch.Tensor:
    return _filled(shape, torch.bfloat16, lambda t: t.normal_())


def time_pass(run, weights, xs, outs) -> float:
    t0 = time.perf_counter()
    for w, x, o in zip(weights, xs, outs):
        run(x, w, o)
    return time.perf_counter() - t0


def io_for(shapes, rows: int):
    lead = () if rows == 1 else (rows,)
    xs = {s: torch.randn(*lead, s[1], dtype=torch.bfloat16) for s in set(shapes)}
    outs = {s: torch.empty(*lead, s[0], dtype=torch.bfloat16) for s in set(shapes)}
    return [xs[s] for s in shapes], [outs[s] for s in shapes]


def bench_set(preset: str, shapes, fmts, rows: int, reps: int, isa: str, names, scale_dtype, bf16_names=("c-prefetch",)) -> None:
    row_class = qc.ONE if rows == 1 else (qc.FEW if rows <= 16 else qc.MANY)
    xs, outs = io_for(shapes, rows)
    bf16 = [bf16_weight(s) for s in shapes]
    bf16_bytes = sum(w.numel() * 2 for w in bf16)
    table = (ONE_ROW if rows == 1 else FEW_ROW).by_name
    base = {}
    if rows > 16:
        base["bf16 mm"] = (lambda x, w, o: torch.mm(x, w.t(), out=o), bf16, bf16_bytes)
    else:
        for name in bf16_names:
            if name not in table:
                raise SystemExit(f"--bf16: {name!r} is not one of {', '.join(table)}")
            why = table[name].unavailable("bfloat16", torch.device("cpu"))  # also builds it
            if why:
                raise SystemExit(f"bf16 {name}: {why}")
            base[f"bf16 {name}"] = (table[name].run, bf16, bf16_bytes)
    print(f"\n{preset}: {len(shapes)} weights per pass, {rows} row(s) per call, {torch.get_num_threads()} threads; "
          f"bf16 {bf16_bytes / 2**20:.0f} MiB per pass")
    for fmt in fmts or [None]:
        weights = [random_weight(s, fmt, scale_dtype) for s in shapes] if fmt else []
        qbytes = sum(w.nbytes for w in weights)
        runs = dict(base)
        prepared: dict[str, list] = {}
        for c in qc.available(row_class, fmt) if fmt else ():
            if names and c.name not in names:
                continue
            # A compiled candidate as built for --isa (the registry's is native); none: that build lacks it.
            run = c.built_for(isa) if c.built_for else c.run
            if run is None:
                continue
            if c.layout not in prepared:
                prepared[c.layout] = [c.prepare(w) if c.prepare else w for w in weights]
            runs[c.name] = (run, prepared[c.layout], qbytes)
        for run, ws, _ in runs.values():  # first calls build, load and warm up
            time_pass(run, ws, xs, outs)
        seconds = {name: [] for name in runs}
        for rep in range(reps):
            for name in alternate(list(runs), rep):
                run, ws, _ = runs[name]
                seconds[name].append(time_pass(run, ws, xs, outs))
        print(f"  {fmt} ({scale_dtype_name(scale_dtype)} scales): {qbytes / 2**20:.0f} MiB per pass" if fmt else "  bf16 only")
        for name, (_, _, nbytes) in runs.items():
            gbps = [nbytes / s / 1e9 for s in seconds[name]]
            ms = [s * 1e3 for s in seconds[name]]
            print(f"    {name:16s} {spread(gbps)} GB/s   {spread(ms, 2)} ms/pass")
        del weights, prepared, runs


def scale_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def errors(fmts, scale_dtype, isa: str) -> None:
    """Each candidate's error against the reference on one weight of real-looking values: how
    many outputs differ from the reference rounded once to bf16, the largest |out - reference|
    over the largest |reference|, and the RMS of out - reference over the RMS of the reference
    (the reference in fp32, before rounding; rounding it alone is the floor of both)."""
    torch.manual_seed(0)
    out_f, in_f, rows = 1024, 5120, 4
    w = torch.randn(out_f, in_f) * 0.02
    x = torch.randn(rows, in_f).to(torch.bfloat16)
    print(f"\nerror against the fp32 reference, {out_f}x{in_f} weight (N(0, 0.02)), {rows} rows of N(0, 1) bf16 x:")
    for fmt in fmts:
        scheme, group, symmetric = qc.parse_format(fmt)
        qw = quantize(w, scheme, group, symmetric, scale_dtype)
        ref = torch.empty(rows, out_f)
        quant_linear_reference(x, qw, ref)
        full = x.float() @ w.t()
        rms = lambda d, r: (d.pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()  # noqa: E731
        rounded = ref.to(torch.bfloat16).float()
        worst = lambda d, r: (d.abs().max() / r.abs().max()).item()  # noqa: E731
        print(f"  {fmt} ({scale_dtype_name(scale_dtype)} scales): the quantization itself {rms(ref - full, full):.2e} RMS of the unquantized product; "
              f"rounding the reference to bf16: max {worst(rounded - ref, ref):.2e}, RMS {rms(rounded - ref, ref):.2e}")
        for row_class in (qc.ONE, qc.FEW, qc.MANY):
            for c in qc.available(row_class, fmt) if fmt else ():
                if c.name in qc.PREFETCH_ONLY:  # another's sums
                    continue
                run = c.built_for(isa) if c.built_for else c.run
                if run is None:
                    continue
                prep = c.prepare(qw) if c.prepare else qw
                got = torch.empty(rows, out_f, dtype=torch.bfloat16)
                if row_class == qc.ONE:
                    for i in range(rows):
                        run(x[i].contiguous(), prep, got[i])
                else:
                    run(x, prep, got)
                d = got.float() - ref
                moved = (got.float() != rounded).float().mean().item()
                print(f"    {row_class:8s} {c.name:13s} {moved:7.2%} of outputs off the rounded reference, max {worst(d, ref):.2e}, RMS {rms(d, ref):.2e}")


def _layers(args, preset: str) -> tuple[int | None, bool]:
    """step_shapes' layers and head for the preset: --layers, else its default (with the head
    where that is all of it)."""
    layers = args.layers if args.layers is not None else DEFAULT_LAYERS.get(preset)
    return layers, layers is None


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--preset", default="small,qwen3.8-27b", help="comma-separated presets whose layer shapes are streamed")
    p.add_argument("--layers", type=positive_int, help="layers per pass (default: all of small with its head; 2 of the 27B without)")
    p.add_argument("--schemes", type=scheme_list, default="int8,int4-g32,int4-g64,int4-g128", help="weight formats, as --quantize takes them ('' for none: the bf16 kernels alone)")
    p.add_argument("--bf16", default="c-prefetch", help="comma-separated bf16 candidates timed beside them on bf16 weights of the same shapes (default c-prefetch)")
    p.add_argument("--scale-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", type=int_list(1), default="1", help="comma-separated x rows per call (1: one-row kernels; 2..16: few-row)")
    p.add_argument("--reps", type=positive_int, default=6)
    p.add_argument("--isa", default="native", choices=list(compiled.ISA_FLAGS), help="the build of the compiled kernels (avx512f/avx2/scalar: with wider paths off)")
    p.add_argument("--candidates", default="", help="comma-separated candidate names to time (default: every one available)")
    p.add_argument("--errors", action="store_true", help="print each candidate's error against the reference, then the timings")
    p.add_argument("--no-timing", action="store_true", help="with --errors: only the errors")
    args = p.parse_args(argv)
    if args.no_timing and not args.errors:
        p.error("--no-timing goes with --errors (alone it would print nothing)")
    names = {n for n in args.candidates.split(",") if n}
    known = {c.name for table in qc.BY_ROWS.values() for c in table}
    if names - known:
        p.error(f"--candidates: no candidate {', '.join(sorted(names - known))}; the quantized candidates: {', '.join(sorted(known))}")
    fmts = args.schemes
    bf16_names = [n for n in args.bf16.split(",") if n]
    for rows in args.rows:
        table = {} if rows > 16 else (ONE_ROW if rows == 1 else FEW_ROW).by_name
        if rows <= 16 and set(bf16_names) - set(table):
            p.error(f"--bf16: {', '.join(sorted(set(bf16_names) - set(table)))} not among the {rows}-row candidates {', '.join(table)}")
    # Every preset's shapes before any timing: an unknown name is refused before the first sum.
    shapes = {preset: step_shapes(preset, *_layers(args, preset)) for preset in args.preset.split(",")}
    scale_dtype = getattr(torch, args.scale_dtype)
    # POCKETLLM_ISA narrows --isa further (compiled.with_isa): name the build that ran.
    order = list(compiled.ISA_FLAGS)
    ran = max(args.isa, compiled.isa(), key=order.index)
    build = f"{ran} build" + ("" if ran == args.isa else f"; --isa {args.isa} narrowed by {compiled.ENV_ISA}={ran}")
    print(machine())
    print(f"{torch.get_num_threads()} threads; compiled int4 {native.isa('int4', args.isa)}, int8 {native.isa('int8', args.isa)} ({build})")
    if args.errors:
        errors(fmts, scale_dtype, args.isa)
    if args.no_timing:
        return 0
    before = read_bandwidths_gbps()
    print("1 GiB fp32 sum, before: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in before.items()))
    for preset, preset_shapes in shapes.items():
        for rows in args.rows:
            bench_set(preset, preset_shapes, fmts, rows, args.reps, args.isa, names, scale_dtype, bf16_names)
    after = read_bandwidths_gbps()
    print("1 GiB fp32 sum, after: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in after.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

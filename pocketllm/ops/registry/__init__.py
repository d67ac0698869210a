"""The kernel registry: for every kind of projection kernel, its candidates, how POCKETLLM_KERNELS
forces one, the measurement that picks one on the machine that runs (trusted only when the machine was
quiet and the result plausible), the wash rule, the cache of trusted choices and its check at load.
The engine owns the chosen set (KernelSet) and binds each projection layer to it.

How a projection call finds its kernel
    row_class(rows) says which class a call of `rows` rows is in: one-row (a decode row), few-row
    (a decode step of several sequences, up to FEW_MAX) or many-row (a prefill). It is the one
    place that decides what a decode row is; ForwardContext.one_row asks it too. KernelSet.bind
    resolves, per weight, the kernel for every row count; the layer keeps that (layer.kernels).

Adding a kind (e.g. int4 weights at one row)
    Declare it in a module of this package and import that module below:

        register(Kind(name, family, rows, candidates, default, prefer=..., probe=..., streams=...))

    - family: "float" (bf16/fp16/fp32 tensors), "int8" or "int4": weight_format() names a weight's
      format ("bfloat16", "int8", "int4-g128", "int4-g128-asym"), format_family() its family. One
      kind per (family, row class); a family without a few-row kind runs few rows with its
      many-row kind, and every family needs a one-row and a many-row kind.
    - forcing: POCKETLLM_KERNELS=kind=name,... forces a candidate by name, the kind named by
      Kind.setting ("one-row", "int8-one-row"; one-line UsageError, exit 2, naming the valid kinds
      or names, for anything else); check_forced() refuses, before any rank starts, a forced
      candidate whose unavailable() is not "" for the run's formats.
    - candidates: Candidate(name, run, what, unavailable=..., prepare=..., layout=..., sources=...).
      run(x, prepared, out) -> None writes into out: one row x [in] -> out [out] (one-row kinds),
      else x [m, in] -> out [m, out]; x and out in the activation dtype (a quantized weight's
      scales' dtype). It must equal the kind's reference (for quantized weights
      ops.quant.layout.quant_linear_reference) up to fp32 summation order; tests compare them.
      unavailable(weight_format, device) -> "" or one line saying why it cannot run there.
      prepare(weight) -> prepared: its own layout of the weight (say torch's int4pack), made once
      when a layer is bound and kept in the layer's bound kernels beside the loaded weight (which
      other row classes' candidates may run); candidates with the same `layout` share one
      prepared form. None: it runs the weight as loaded. sources: files whose text the choice depends on (compiled kernels): part of the
      cache key. measured=False: never timed (a plain torch form far slower than the rest; it runs
      as the default or forced). copies=True: its prepared form is a second copy of the weight in
      another layout; a measured choice of it gives way to the fastest candidate of the loaded
      layout (Choice.runs), so a layer never holds both, unless it is forced.
    - default: what runs where nothing was measured (off the CPU, a single candidate).
    - prefer: the wash rule is one for all kinds (pick(): the fastest, unless a candidate within
      WASH of it comes earlier in `prefer`); a kind only orders its preference.
    - probe: how measuring picks probe weights. "stream": the model's own weights of each shape
      in step order, each shape's share of PASS_BYTES, so every call finds its weight out of
      cache as in a real step; a choice per shape. "widest": one probe of PROBE_ROWS rows
      against up to PROBE_OUT rows of the widest weight; one choice per format. Candidates with
      prepare() are timed on prepared copies of the probe weights, made before the timing.
    - streams: its best kernel reads a weight too big for the caches near the machine's read
      rate; a measurement far below that is implausible (trust.implausible).

Trust (trust.py, choose.py)
    A measurement runs under a Monitor (other processes' CPU time and stolen time from
    /proc/stat over its window, this process's and its peer ranks' own time excluded). A
    disturbed or implausible one is retried (ATTEMPTS); if still so, it is used for this run
    only, not written, and the choice's `how` says so ("measured, machine busy: not cached").
    Cached entries must be whole and plausible, and are re-checked at load (every key's cached
    kernel against its runner-up, CHECK_PASSES passes); a quiet check that disagrees beyond noise
    measures the kind again. The cache file (cache.py) is written under a lock, merged, and
    renamed into place.
"""

from pocketllm.ops.registry import float_kinds, panel_kinds, quant_kinds  # noqa: F401 (registers the kinds)
from pocketllm.ops.registry.choose import NOT_CACHED_BUSY, NOT_CACHED_IMPLAUSIBLE, WASH, Choice, choose, pick
from pocketllm.ops.registry.kernel_set import BoundKernels, KernelSet, default_kernels
from pocketllm.ops.registry.kinds import (
    ENV_INVARIANT,
    ENV_KERNELS,
    FEW,
    FEW_MAX,
    MANY,
    ONE,
    Candidate,
    Kind,
    all_kinds,
    batch_invariant,
    check_forced,
    dtype_format,
    few_rows_for,
    forced_kernels,
    format_family,
    kind_for,
    one_row,
    register,
    row_class,
    weight_format,
)
from pocketllm.ops.registry.trust import Monitor

ONE_ROW, FEW_ROW, MANY_ROW = float_kinds.ONE_ROW, float_kinds.FEW_ROW, float_kinds.MANY_ROW

__all__ = [
    "ENV_INVARIANT", "ENV_KERNELS", "batch_invariant", "FEW", "FEW_MAX", "FEW_ROW", "MANY", "MANY_ROW", "NOT_CACHED_BUSY", "NOT_CACHED_IMPLAUSIBLE", "ONE", "ONE_ROW", "WASH",
    "BoundKernels", "Candidate", "all_kinds", "Choice", "Kind", "KernelSet", "Monitor",
    "check_forced", "choose", "dtype_format", "default_kernels", "few_rows_for", "forced_kernels", "format_family", "kind_for", "one_row", "pick",
    "register", "row_class", "weight_format",
]

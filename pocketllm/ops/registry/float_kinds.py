"""The kinds for plain bf16/fp16/fp32 weights: one row (a decode step), a few rows (a decode step of
several sequences) and many rows (a prefill). Each is a list of candidates; the registry does the
rest."""

from __future__ import annotations

from pocketllm.ops import many_rows
from pocketllm.ops.gemv import kernels as gemv
from pocketllm.ops.registry.kinds import FEW, MANY, ONE, Candidate, Kind, register

_C = (gemv.SOURCE,)
# The compiled kernels' per-row order: the few-row tile sums each (weight row, x row) pair as the
# one-row kernel sums that weight row (gemv_bf16.c; tests/test_gemv.py holds them bit for bit).
_ORDER = "gemv_bf16.c"
# The AMX tile product's per-row order: the tile unit's, the same for a row whatever the other rows.
_AMX_ORDER = "amx tiles"

ONE_ROW = register(
    Kind(
        ONE, "float", ONE,
        (
            Candidate("mv", gemv.mv, "torch.mv (oneDNN for bf16/fp16 where torch has it)"),
            Candidate("mv-native", gemv.mv_native, "torch.mv with oneDNN off (torch's own kernel)", gemv.onednn_unavailable),
            Candidate("mm", gemv.mm_one_row, "torch.mm of one row (F.linear's path)"),
            Candidate(
                "c", gemv.compiled_gemv(0), "pocketllm's compiled bf16 GEMV (pocketllm/ops/gemv/gemv_bf16.c)", gemv.compiled_unavailable,
                sources=_C, row_order=_ORDER, takes_rows=True,
            ),
            Candidate(
                "c-prefetch", gemv.compiled_gemv(gemv.PREFETCH_BYTES),
                "the same, each weight row also prefetched non-temporally a few rows ahead", gemv.compiled_unavailable, sources=_C,
                row_order=_ORDER, takes_rows=True,
            ),
            Candidate(
                "c-ahead", gemv.compiled_gemv(0, gemv.AHEAD_BYTES),
                "the same, each weight row prefetched into every cache level AHEAD_BYTES ahead", gemv.compiled_unavailable, sources=_C,
                row_order=_ORDER, takes_rows=True,
            ),
            Candidate(
                "c-group", gemv.compiled_gemv(0, group=True),
                "the same four weight rows at a time against one x, each row summed as alone (the AVX2 build)", gemv.group_unavailable,
                sources=_C, row_order=_ORDER, takes_rows=True,
            ),
            Candidate(
                "c-group-ahead", gemv.compiled_gemv(0, gemv.AHEAD_BYTES, group=True),
                "the same, each weight row prefetched into every cache level AHEAD_BYTES ahead", gemv.group_unavailable, sources=_C,
                row_order=_ORDER, takes_rows=True,
            ),
            # Never measured in: a step of one row streams no faster on the tiles, and a little
            # slower where a weight's rows are short. Forced, it sums a row as the few-row tile
            # product does, so a batch-invariant set takes the tiles for every row count
            # (docs/batching.md, AMX).
            Candidate(
                "amx", gemv.amx_gemv, "one row on the AMX tiles, each row summed as by the few-row AMX kernel", gemv.amx_unavailable,
                sources=_C, row_order=_AMX_ORDER, measured=False,
            ),
        ),
        default="mv",
        # Timed alone, torch's oneDNN calls and the compiled kernels can come out level while a
        # real step, with other work between them, runs the compiled ones faster (docs/decode.md,
        # near ties). Among the compiled ones a wash goes to c-ahead: its
        # prefetches cost nothing where the memory is what limits (where the candidates tie), and
        # where a core's own prefetchers limit (one thread, or a host whose memory is idle for a
        # moment), which a load-time measurement may not meet, it is the faster.
        prefer=("c-ahead", "c", "c-prefetch", "c-group-ahead", "c-group"),
        streams=True,
    )
)

FEW_ROW = register(
    Kind(
        FEW, "float", FEW,
        (
            Candidate("mm", many_rows.mm, "torch.mm (oneDNN's GEMM where torch has it)"),
            Candidate(
                "c", gemv.compiled_rows(0), "pocketllm's compiled bf16 few-row GEMM (pocketllm/ops/gemv/gemv_bf16.c)", gemv.compiled_unavailable,
                sources=_C, row_order=_ORDER,
            ),
            Candidate(
                "c-prefetch", gemv.compiled_rows(gemv.PREFETCH_BYTES),
                "the same, each weight row prefetched non-temporally PREFETCH_BYTES ahead", gemv.compiled_unavailable, sources=_C,
                row_order=_ORDER,
            ),
            Candidate(
                "c-ahead", gemv.compiled_rows(0, gemv.AHEAD_BYTES),
                "the same, each weight row prefetched into every cache level AHEAD_BYTES ahead", gemv.compiled_unavailable, sources=_C,
                row_order=_ORDER,
            ),
            Candidate(
                "c-next", gemv.compiled_rows_next(gemv.NEXT_AHEAD_BYTES),
                "the same, each weight row's prefetch reaching into the next block of rows, so memory streams through every pass over x",
                gemv.compiled_unavailable, sources=_C, row_order=_ORDER,
            ),
            Candidate(
                "c-wide", gemv.compiled_wide_rows(1, gemv.WIDE_AHEAD_BYTES),
                "the same with each thread's weight rows streamed one at a time against up to eight x rows",
                gemv.wide_unavailable(1), sources=_C, row_order=_ORDER,
            ),
            Candidate(
                "c-wide2", gemv.compiled_wide_rows(2, gemv.WIDE2_AHEAD_BYTES),
                "the same two weight rows at a time, prefetched WIDE2_AHEAD_BYTES ahead", gemv.wide_unavailable(2), sources=_C,
                row_order=_ORDER,
            ),
            Candidate(
                "c-blocked", gemv.compiled_blocked_rows(gemv.BLOCKED_X_BYTES, gemv.BLOCKED_ROWS),
                "the same blocked for the caches: a block of weight rows against x a block of inputs at a time, the next block asked for into L2 (AVX2, AVX-512 without BF16)",
                gemv.blocked_unavailable, sources=_C, row_order=_ORDER,
            ),
            # A tile product sums 32 products per step in the tile unit's own order: not the
            # compiled one-row kernels', so a batch-invariant set takes it only beside the one-row
            # AMX form (forced), else with POCKETLLM_BATCH_INVARIANT=0.
            Candidate("amx", gemv.amx_rows, "the same on AMX tiles, where the CPU has them", gemv.amx_unavailable, sources=_C, row_order=_AMX_ORDER),
        ),
        default="mm",
        prefer=("amx", "c", "c-prefetch", "c-ahead", "c-next", "c-wide", "c-wide2", "c-blocked"),
    )
)

MANY_ROW = register(
    Kind(
        MANY, "float", MANY,
        (
            Candidate("mm", many_rows.mm, "torch.mm in the weight's dtype"),
            Candidate(
                "mm-f32", many_rows.mm_f32, "the weight widened to fp32 a block of rows at a time, torch's fp32 GEMM",
                lambda fmt, device: "" if device.type == "cpu" and fmt in ("bfloat16", "float16") else "widening to fp32 is for bf16/fp16 weights on a CPU",
            ),
            Candidate(
                "c-f32", many_rows.c_f32, "bf16 weights widened to fp32 as they are packed, a compiled 6 x 16 fp32 FMA tile (ops/many_rows_bf16.c, AVX2)",
                many_rows.c_f32_unavailable, sources=(many_rows.SOURCE,),
            ),
        ),
        default="mm",
        # The widened GEMM allocates a block of fp32 per call: a wash keeps torch's own.
        prefer=("mm",),
        probe="widest",
    )
)

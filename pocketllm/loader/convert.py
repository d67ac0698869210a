"""Writing a quantized checkpoint in the compressed-tensors pack-quantized layout
(pocketllm.loader.compressed_tensors) from any weight source, a block of rows at a time: a
checkpoint's float (or fp8) tensors, or a preset's generated ones. Each block of a projection is
quantized as it is read (quantization is row-local, so blocks give the whole matrix's values),
and written to its place in the output; memory holds one block, whatever the model's size."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from pocketllm.loader.compressed_tensors import to_packed
from pocketllm.loader.stream_writer import Entry, ShardWriter
from pocketllm.ops.quant.layout import quantize
from pocketllm.quantization import WeightScheme

# Rows quantized and written at a time: a multiple of 8, so the packed zero points (eight rows
# to a word) of each block are whole words.
BLOCK_ROWS = 1024

# name -> (first row, rows) blocks of the tensor, in row order.
Blocks = Callable[[str], Iterator[tuple[int, torch.Tensor]]]


def output_entries(tensors: list[Entry], quantized: dict[str, WeightScheme], scale_dtype: Callable[[Entry], torch.dtype]) -> list[Entry]:
    """What the output holds: each quantized weight's packed tensors in place of it (scales in
    scale_dtype(entry)), every other tensor as it is."""
    out = []
    for e in tensors:
        scheme = quantized.get(e.name)
        if scheme is None:
            out.append(e)
            continue
        rows, cols = e.shape
        groups = 1 if scheme.bits == 8 else cols // scheme.group
        out += [
            Entry(e.name + "_packed", torch.int32, (rows, cols * scheme.bits // 32)),
            Entry(e.name + "_scale", scale_dtype(e), (rows, groups)),
            Entry(e.name + "_shape", torch.int64, (2,)),
        ]
        if not scheme.symmetric:
            out.append(Entry(e.name + "_zero_point", torch.int32, (math.ceil(rows * scheme.bits / 32), groups)))
    return out


def write_quantized(
    out: Path, tensors: list[Entry], blocks: Blocks, quantized: dict[str, WeightScheme], max_bytes: int,
    scale_dtype: Callable[[Entry], torch.dtype], dtype_of: Callable[[Entry], torch.dtype], label: str,
) -> int:
    """Write `tensors` (the source's entries, in order) to `out`, the ones in `quantized` packed;
    dtype_of(entry) is the dtype an unquantized tensor is written in. A progress bar counts the
    source's bytes. Returns the number of shards."""
    entries = output_entries([Entry(e.name, dtype_of(e), e.shape) if e.name not in quantized else e for e in tensors], quantized, scale_dtype)
    writer = ShardWriter(out, entries, max_bytes)
    bar = tqdm(total=sum(e.nbytes for e in tensors), unit="B", unit_scale=True, unit_divisor=1024, desc=label, leave=False, dynamic_ncols=True, mininterval=1.0,
               disable=None)  # drawn where stderr is a terminal only, as the loading bar
    try:
        for e, r0, block in _read_ahead(tensors, blocks):
            scheme = quantized.get(e.name)
            if scheme is None:
                writer.write(e.name, block.to(dtype_of(e)), r0)
            else:
                qw = quantize(block, scheme.kind, scheme.group, scheme.symmetric, scale_dtype=scale_dtype(e))
                for suffix, t in to_packed(qw).items():
                    if suffix == "_shape":
                        writer.write(e.name + suffix, torch.tensor(list(e.shape), dtype=torch.int64))
                    else:
                        writer.write(e.name + suffix, t, r0 // 8 if suffix == "_zero_point" else r0)
            bar.update(block.numel() * e.dtype.itemsize)
    finally:
        bar.close()
        writer.close()
    return writer.shards


def _read_ahead(tensors: list[Entry], blocks: Blocks, depth: int = 2):
    """(entry, first row, rows) for every block of every tensor, in order, read (or generated) on
    a thread of its own up to `depth` blocks ahead: torch's ops let go of the GIL, so reading the
    next block runs beside quantizing and writing this one."""
    ahead: queue.Queue = queue.Queue(maxsize=depth)

    def produce():
        try:
            for e in tensors:
                for r0, block in blocks(e.name):
                    ahead.put((e, r0, block))
            ahead.put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            ahead.put(exc)

    threading.Thread(target=produce, daemon=True).start()
    while (item := ahead.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


def ignored_modules(tensors: list[Entry], quantized: dict[str, WeightScheme], tied_head: bool) -> list[str]:
    """The linear modules left unquantized, as compressed-tensors' ignore list names them: every
    other 2-D `.weight` but the embeddings; and a head tied to the embedding, which has no weight
    of its own in the file but is a linear module every reader would otherwise quantize."""
    names = [
        e.name.removesuffix(".weight")
        for e in tensors
        if e.name.endswith(".weight") and len(e.shape) == 2 and e.name not in quantized and "embed" not in e.name
    ]
    return names + ["lm_head"] if tied_head and "lm_head" not in names else names

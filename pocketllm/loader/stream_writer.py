"""Writing safetensors shards a block of rows at a time: every tensor's name, dtype and shape are
known before the first byte, so each shard's header is written first and each block of rows goes
straight to its place in the file. A checkpoint far larger than memory (the 64-layer preset,
quantized) is written holding one block at a time."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pocketllm.loader.checkpoint import INDEX, SINGLE

DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class ShardWriter:
    """Shards of at most `max_bytes` (a tensor larger than that gets a shard to itself), named as
    HF names them, with an index when there is more than one."""

    def __init__(self, out: Path, entries: list[Entry], max_bytes: int):
        self.out = Path(out)
        shards: list[list[Entry]] = [[]]
        size = 0
        for e in entries:
            if shards[-1] and size + e.nbytes > max_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += e.nbytes
        self.where: dict[str, tuple[int, int, Entry]] = {}  # name -> (shard, absolute offset, entry)
        self.files = []
        names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for i, (fname, shard) in enumerate(zip(names, shards)):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for e in shard:
                header[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
                offset += e.nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            f = open(self.out / fname, "wb")
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)
            start = 8 + len(text)
            for e in shard:
                self.where[e.name] = (i, start + header[e.name]["data_offsets"][0], e)
            self.files.append(f)
        if len(shards) == 1:
            # An index left by an earlier write to this directory would be read instead.
            (self.out / INDEX).unlink(missing_ok=True)
        else:
            weight_map = {e.name: names[i] for i, shard in enumerate(shards) for e in shard}
            # total_size as HF writes it: the tensors' bytes, headers left out.
            total = sum(e.nbytes for e in entries)
            (self.out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        self.shards = len(shards)

    def write(self, name: str, tensor: torch.Tensor, row0: int = 0) -> None:
        """Rows row0.. of tensor `name` (all of it at row0 0 with its full shape)."""
        shard, offset, e = self.where[name]
        if tensor.dtype != e.dtype or tuple(tensor.shape[1:]) != e.shape[1:] or row0 + (tensor.shape[0] if tensor.dim() else 1) > (e.shape[0] if e.shape else 1):
            raise ValueError(f"{name}: writing {tensor.dtype} {list(tensor.shape)} at row {row0} into {e.dtype} {list(e.shape)}")
        row_bytes = e.nbytes // e.shape[0] if e.shape and e.shape[0] else e.nbytes
        f = self.files[shard]
        f.seek(offset + row0 * row_bytes)
        f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        for f in self.files:
            f.close()

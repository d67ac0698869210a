"""A HF safetensors checkpoint: `model.safetensors` or shards listed in
`model.safetensors.index.json` (where a directory holds both, the single file, as transformers
reads it), text weights under `model.` or `model.language_model.`.
Tensors are read through safetensors slices, so a rank reads only its own part. Never pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open

from pocketllm.errors import CheckpointError, not_a_file
from pocketllm.loader.formats import SCALE_SUFFIX

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Multimodal releases nest the text model one level deeper.
TEXT_PREFIXES = ("model.language_model.", "model.")
# Weights a text engine does not use.
SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


class CheckpointReader:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            if self.dir.exists():
                raise CheckpointError(f"checkpoint {self.dir} is not a directory: give the directory that holds config.json and the safetensors")
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        # Each shard is opened once to map its keys and stays open for the model check, which
        # reads its tensors' shapes and dtypes from the same parsed header; close() unmaps them.
        # The check opens it as numpy arrays: the launcher runs it and never imports torch. A
        # rank reads the weights through handles of torch's.
        self._handles: dict[tuple[Path, str], object] = {}
        # What a run says about the files it reads, where _map_keys made a choice.
        self.note: str | None = None
        self.file_of = self._map_keys()
        self.prefix = self._text_prefix()
        # An fp8 checkpoint's block (config.json's weight_block_size), set by the plan.
        self.fp8_block: tuple[int, int] = (128, 128)

    def _map_keys(self) -> dict[str, Path]:
        index, single = self.dir / INDEX, self.dir / SINGLE
        if single.is_file() and index.is_file():
            # Two sets of weights may disagree (one left from an earlier save): read the one
            # transformers reads, and say so unless the index lists that file alone.
            if self._shards_listed(index) != {SINGLE}:
                self.note = f"note: {self.dir} holds both {SINGLE} and {INDEX}: reading {SINGLE} (as transformers does), not the shards the index lists"
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map must map each tensor name to a shard's file name")
            outside = sorted({f for f in weight_map.values() if Path(f).is_absolute() or ".." in Path(f).parts})
            if outside:
                raise CheckpointError(f"{index} names shard(s) outside the checkpoint directory: {', '.join(outside[:3])}")
            missing = sorted({f for f in weight_map.values() if not (self.dir / f).is_file()})
            if missing:
                there = [f"{f} ({not_a_file(self.dir / f)})" for f in missing if os.path.lexists(self.dir / f)]
                if there:
                    raise CheckpointError(f"{index} names shard(s) that are no file to read: {', '.join(there)}")
                raise CheckpointError(f"{index} names shard(s) that are absent: {', '.join(missing)}")
            held = {f: set(self._check_readable(self.dir / f)) for f in sorted(set(weight_map.values()))}
            astray = sorted(key for key, f in weight_map.items() if key not in held[f])
            if astray:
                shown = ", ".join(f"{k} (not in {weight_map[k]})" for k in astray[:5])
                more = f" and {len(astray) - 5} more" if len(astray) > 5 else ""
                raise CheckpointError(f"{index} maps {len(astray)} tensor(s) to a shard that does not hold them: {shown}{more}")
            return {key: self.dir / f for key, f in weight_map.items()}
        if not single.is_file():
            for path in (single, index):
                # There, but nothing to read: say what it is rather than that it is absent.
                if os.path.lexists(path):
                    raise CheckpointError(f"{path} {not_a_file(path)}")
            if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt")):
                raise CheckpointError(f"{self.dir} has only pickle weights (.bin/.pt); pocketllm reads safetensors only")
            raise CheckpointError(f"{self.dir} has neither {SINGLE} nor {INDEX}")
        keys = self._check_readable(single)
        return {key: single for key in keys}

    @staticmethod
    def _shards_listed(index: Path) -> set[str]:
        try:
            return set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return set()

    def _check_readable(self, path: Path) -> list[str]:
        try:
            return list(self._handle(path, "numpy").keys())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path} is truncated or corrupt: {exc}") from None

    def _text_prefix(self) -> str:
        for prefix in TEXT_PREFIXES:
            if any(k.startswith(prefix + "layers.") or k == prefix + "embed_tokens.weight" for k in self.file_of):
                return prefix
        return "model."

    def to_file_key(self, name: str) -> str:
        """Canonical name (`model.layers.0...`, `lm_head.weight`) -> name in this checkpoint."""
        return self.prefix + name[len("model.") :] if name.startswith("model.") else name

    def from_file_key(self, key: str) -> str | None:
        if key.startswith(self.prefix):
            return "model." + key[len(self.prefix) :]
        if key.startswith(SKIPPED_PREFIXES) or key.startswith("model."):
            return None
        return key

    def canonical_keys(self) -> set[str]:
        return {c for k in self.file_of if (c := self.from_file_key(k)) is not None}

    def _handle(self, path: Path, framework: str = "pt"):
        if (path, framework) not in self._handles:
            self._handles[(path, framework)] = safe_open(str(path), framework=framework)
        return self._handles[(path, framework)]

    def get_slice(self, name: str):
        """The tensor `name` as a safetensors slice; an fp8 weight with its block scales reads as
        fp32 (pocketllm.loader.fp8)."""
        return self.file_slice(self.to_file_key(name))

    def file_slice(self, key: str):
        """get_slice by the name the checkpoint gives the tensor."""
        sl = self._handle(self.file_of[key]).get_slice(key)
        scale = key + SCALE_SUFFIX
        if scale in self.file_of and sl.get_dtype() == "F8_E4M3":
            # Only a rank reads a slice: the launcher checks headers and never imports torch.
            from pocketllm.loader.fp8 import Fp8Slice

            return Fp8Slice(sl, self._handle(self.file_of[scale]).get_slice(scale), self.fp8_block)
        return sl

    def raw_slice(self, name: str):
        """The tensor `name` as stored, for the model check: its shape and dtype, and a small
        integer tensor's values, read as numpy (no torch)."""
        key = self.to_file_key(name)
        return self._handle(self.file_of[key], "numpy").get_slice(key)

    def stored_slice(self, key: str):
        """The tensor the checkpoint names `key`, as stored."""
        return self._handle(self.file_of[key]).get_slice(key)

    def has(self, name: str) -> bool:
        return self.to_file_key(name) in self.file_of

    def __getstate__(self) -> dict:
        # The reader travels to the other ranks with the model plan: its key map, not its files.
        return {**self.__dict__, "_handles": {}}

    def close(self) -> None:
        """Unmap the files: the pages a read touched count in this process's memory until then.
        A later read reopens its file, which costs only the header."""
        self._handles.clear()

"""`pocketllm quantize`: write a float (or fp8) checkpoint's projection and head weights quantized,
as a compressed-tensors pack-quantized checkpoint (the layout vLLM and llm-compressor read and
write; docs/quantization.md), the rest as it is, and its tokenizer and other files copied. The
result loads with no flag, giving the numbers `--quantize` gives at load."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch

from pocketllm.config import load_config
from pocketllm.errors import UsageError
from pocketllm.loader.checkpoint import INDEX, CheckpointReader
from pocketllm.loader.compressed_tensors import quantization_config
from pocketllm.loader.convert import BLOCK_ROWS, ignored_modules, write_quantized
from pocketllm.loader.model_tensors import model_tensors, projections
from pocketllm.loader.checks import UNSET, check_split, plan_weights, validate_source
from pocketllm.loader.formats import SCALE_SUFFIX, check_host
from pocketllm.loader.new_dir import check_new_dir, written_whole
from pocketllm.loader.stream_writer import DTYPE_NAMES, Entry
from pocketllm.quantization import SCHEME_HELP, WeightPlan, parse_scheme

TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def add_arguments(p) -> None:
    p.add_argument("--ckpt", required=True, help="HF checkpoint directory (config.json + safetensors), float or fp8")
    p.add_argument("--out", required=True, help="directory to write: new, or empty")
    p.add_argument("--scheme", required=True, help=SCHEME_HELP.removeprefix("none, "))
    p.add_argument("--max-shard-mib", type=int, default=4096, help="shard size above which the output is split, with an index (default 4096)")


def run(args) -> int:
    scheme = parse_scheme(args.scheme, "--scheme", none=False)
    if scheme is None:
        raise UsageError(f"--scheme none writes nothing new: use {SCHEME_HELP.removeprefix('none, ')}")
    if args.max_shard_mib < 1:
        raise UsageError(f"--max-shard-mib must be >= 1, got {args.max_shard_mib}")
    check_host()
    src = Path(args.ckpt)
    if args.out and Path(args.out).resolve() == src.resolve():
        raise UsageError("--out must be another directory than --ckpt")
    if args.out and src.resolve() in Path(args.out).resolve().parents:
        # It would become a folder of the source checkpoint, listed by every later quantize of it.
        raise UsageError(f"--out {args.out} is inside --ckpt {args.ckpt}: give a directory outside the checkpoint")
    out = check_new_dir(args.out)
    reader = CheckpointReader(src)
    if reader.note:
        print(reader.note, file=sys.stderr, flush=True)
    cfg = load_config(src)
    if cfg.quantization is not None and cfg.quantization.method != "fp8":
        raise UsageError(f"{src} is already quantized ({cfg.quantization.label}); quantize a float or fp8 checkpoint")
    # The input is checked as a run would load it, then the scheme against the model's shapes.
    model = model_tensors(cfg)
    validate_source(reader, dataclasses.replace(cfg, weights=plan_weights(cfg, reader, UNSET, model)), model)
    check_split(model, WeightPlan(scheme), 1, f"--scheme {args.scheme}")

    fp8 = {k.removesuffix(SCALE_SUFFIX) for k in reader.file_of if k.endswith(SCALE_SUFFIX)}
    tensors = []
    for key in sorted(reader.file_of):
        if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in fp8:
            continue
        sl = reader.stored_slice(key)
        tensors.append(Entry(key, TORCH_DTYPES[sl.get_dtype()], tuple(sl.get_shape())))
    reader.close()
    # An fp8 release's unconverted modules (modules_to_not_convert) stay float, as at load.
    quantized = {reader.to_file_key(t.key): scheme for t in projections(model) if reader.has(t.key) and (not fp8 or reader.to_file_key(t.key) in fp8)}
    run_dtype = {"float16": torch.float16, "float32": torch.float32}.get(cfg.checkpoint_dtype, torch.bfloat16)

    def blocks(name: str):
        sl = reader.file_slice(name)
        shape = tuple(sl.get_shape())
        if len(shape) != 2:
            yield 0, sl[:]
        else:
            for r0 in range(0, shape[0], BLOCK_ROWS):
                yield r0, sl[r0 : min(r0 + BLOCK_ROWS, shape[0])]
        reader.close()

    def stored_dtype(e: Entry) -> torch.dtype:
        # fp8 weights left unquantized (beyond the text model) become the release's float dtype.
        return e.dtype if e.dtype not in (torch.float8_e4m3fn,) else run_dtype

    def scale_dtype(e: Entry) -> torch.dtype:
        return e.dtype if e.dtype in FLOATS else run_dtype

    with written_whole(out) as work:
        shards = write_quantized(work, tensors, blocks, quantized, args.max_shard_mib * 2**20, scale_dtype, stored_dtype, f"quantize {scheme.name}")
        config = json.loads((src / "config.json").read_text())
        config.pop("quantization_config", None)
        if isinstance(config.get("text_config"), dict):
            config["text_config"].pop("quantization_config", None)
        config["quantization_config"] = quantization_config(scheme, ignored_modules(tensors, quantized, cfg.tie_word_embeddings))
        (work / "config.json").write_text(json.dumps(config, indent=2))
        copied, skipped = [], []
        for f in sorted(src.iterdir()):
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX):
                shutil.copy2(f, work / f.name)
                copied.append(f.name)
            elif f.is_dir():
                # Folders beside a checkpoint's files (an original-format copy of the weights,
                # say) are no part of what loads: left, and said.
                skipped.append(f.name + "/")
    left = f"; not copied: {', '.join(skipped)}" if skipped else ""
    print(f"wrote {src} as {scheme.name} (compressed-tensors pack-quantized, {len(quantized)} weights, {shards} shard(s)) to {out}; "
          f"copied {', '.join(copied) or 'no other files'}{left}")
    return 0

"""`pocketllm make-checkpoint`: write a preset as a real HF-layout checkpoint (config.json,
safetensors, sharded with an index past --max-shard-mib, a byte-level tokenizer.json, and a
tokenizer_config.json with a ChatML chat template, the format Qwen's chat models use). With
--quantize, the projections and head are written quantized (compressed-tensors pack-quantized),
the same numbers `--quantize` gives the preset at load. Tensors are generated and written a
block of rows at a time, so the 64-layer preset is written in a few GiB of memory."""

from __future__ import annotations

import json
from pathlib import Path

from pocketllm.byte_level import byte_symbols
from pocketllm.errors import UsageError
from pocketllm.loader.compressed_tensors import quantization_config
from pocketllm.loader.formats import check_host
from pocketllm.loader.convert import BLOCK_ROWS, ignored_modules, write_quantized
from pocketllm.loader.model_tensors import model_tensors, projections
from pocketllm.loader.checks import check_split
from pocketllm.loader.new_dir import check_new_dir, written_whole
from pocketllm.loader.random_weights import PRESET_DTYPE, RandomWeights, random_row_blocks
from pocketllm.loader.stream_writer import Entry
from pocketllm.model_args import DTYPES, parse_dtype, preset_config
from pocketllm.presets import DEFAULT_PRESET, PRESETS
from pocketllm.quantization import SCHEME_HELP, WeightPlan, parse_scheme


def add_arguments(p) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"{', '.join(PRESETS)} (default {DEFAULT_PRESET})")
    p.add_argument("--layers", type=int, help="cut or extend the stack to N layers (3:1 pattern)")
    p.add_argument("--out", required=True, help="directory to write: new, or empty")
    p.add_argument("--dtype", default="bfloat16", help=f"stored dtype: {', '.join(DTYPES)} (default bfloat16, as released); the "
                   "values are the preset's (bf16) at any dtype")
    p.add_argument("--tie-word-embeddings", action="store_true", help="share the embedding with the LM head")
    p.add_argument("--max-shard-mib", type=int, default=2048, help="shard size above which an index is written (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0: the preset's weights, as run directly at any --dtype)")
    p.add_argument("--quantize", help=f"write the projections and head quantized (compressed-tensors): {SCHEME_HELP}")


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer with one token per byte, id = byte value: any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {sym: b for b, sym in byte_symbols().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


# ChatML as Qwen's chat templates write it, without their tool-calling and reasoning branches: what
# `pocketllm serve` renders for /v1/chat/completions. The byte-level tokenizer has no special
# tokens, so the markers are plain text to it, which changes nothing for a model of random weights.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer_config(path: Path) -> None:
    path.write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": None, "bos_token": None}, indent=2))


def run(args) -> int:
    import dataclasses

    cfg = preset_config(args.preset, args.layers)
    dtype = parse_dtype(args.dtype)
    cfg = dataclasses.replace(cfg, tie_word_embeddings=args.tie_word_embeddings, checkpoint_dtype=args.dtype)
    if args.max_shard_mib < 1:
        raise UsageError(f"--max-shard-mib must be >= 1, got {args.max_shard_mib}")
    out = check_new_dir(args.out)
    scheme = parse_scheme(args.quantize) if args.quantize else None
    model = model_tensors(cfg)
    if scheme is not None:
        check_host()
        check_split(model, WeightPlan(scheme), 1, f"--quantize {args.quantize}")
    source = RandomWeights(cfg, seed=args.seed, dtype=dtype, tensors=model)
    tensors = [Entry(name, dtype, tuple(shape)) for name, shape in source.shapes.items()]
    quantized = {t.key: scheme for t in projections(model)} if scheme is not None else {}

    def blocks(name: str):
        for r0, block in random_row_blocks(name, source.shapes[name], args.seed, BLOCK_ROWS):
            # The preset's values (rounded to bf16), cast first: a quantized weight is quantized
            # from the stored dtype's values, as at load.
            yield r0, block.to(PRESET_DTYPE).to(dtype)

    label = f"make-checkpoint {args.preset}" + (f" {scheme.name}" if scheme else "")
    with written_whole(out) as work:
        shards = write_quantized(work, tensors, blocks, quantized, args.max_shard_mib * 2**20, lambda e: dtype, lambda e: e.dtype, label)
        config = cfg.to_hf_dict()
        if scheme is not None:
            config["quantization_config"] = quantization_config(scheme, ignored_modules(tensors, quantized, cfg.tie_word_embeddings))
        (work / "config.json").write_text(json.dumps(config, indent=2))
        write_byte_tokenizer(work / "tokenizer.json")
        write_tokenizer_config(work / "tokenizer_config.json")
    print(f"wrote {args.preset} ({cfg.num_layers} layers, {scheme.name if scheme else args.dtype}, {shards} shard(s)) to {out}")
    return 0

"""`pocketllm make-checkpoint`: write a preset as a real HF-layout checkpoint (config.json,
safetensors, sharded with an index past --max-shard-mib, a byte-level tokenizer.json, and a
tokenizer_config.json with a ChatML chat template, the format Qwen's chat models use)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from pocketllm.errors import UsageError
from pocketllm.loader.checkpoint import INDEX, SINGLE
from pocketllm.loader.random_weights import RandomWeights
from pocketllm.model_args import parse_dtype, preset_config
from pocketllm.presets import DEFAULT_PRESET, PRESETS


def add_arguments(p) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"{', '.join(PRESETS)} (default {DEFAULT_PRESET})")
    p.add_argument("--layers", type=int, help="cut or extend the stack to N layers (3:1 pattern)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--dtype", default="bfloat16", help="stored dtype (default bfloat16, as released)")
    p.add_argument("--tie-word-embeddings", action="store_true", help="share the embedding with the LM head")
    p.add_argument("--max-shard-mib", type=int, default=2048, help="shard size above which an index is written")
    p.add_argument("--seed", type=int, default=0, help="weight seed (0 matches the preset as run directly)")


def byte_symbols() -> dict[int, str]:
    """The printable symbol byte-level BPE uses for each byte (the GPT-2 table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


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


def run(args, argv) -> int:
    import dataclasses

    cfg = preset_config(args.preset, args.layers)
    dtype = parse_dtype(args.dtype)
    cfg = dataclasses.replace(cfg, tie_word_embeddings=args.tie_word_embeddings, checkpoint_dtype=args.dtype)
    if args.max_shard_mib < 1:
        raise UsageError(f"--max-shard-mib must be >= 1, got {args.max_shard_mib}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create ({exc.strerror})") from None
    source = RandomWeights(cfg, seed=args.seed, dtype=dtype)
    limit = args.max_shard_mib * 2**20
    shards: list[dict] = [{}]
    size = 0
    for name in source.shapes:
        tensor = source.get_slice(name)[:].contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    write_byte_tokenizer(out / "tokenizer.json")
    write_tokenizer_config(out / "tokenizer_config.json")
    print(f"wrote {args.preset} ({cfg.num_layers} layers, {len(shards)} shard(s)) to {out}")
    return 0

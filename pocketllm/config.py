"""The model config: a frozen dataclass built from an HF config.json (flat or nested under
`text_config`) or a preset, with the derived sizes computed once, plus the TP split check."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pocketllm.errors import UsageError, not_a_file
from pocketllm.quantization import CheckpointQuant, WeightPlan, parse_quantization_config

LINEAR = "linear_attention"
FULL = "full_attention"
LAYER_KINDS = (LINEAR, FULL)
# Every fourth layer is full attention: layers 3, 7, ..., as in the released checkpoints.
FULL_ATTENTION_INTERVAL = 4


class ConfigError(UsageError):
    """config.json is unreadable, incomplete or describes a model this engine cannot run."""


def hybrid_layer_types(num_layers: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else LINEAR for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262_144
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "bfloat16"
    # What config.json's quantization_config declares (None: float weights).
    quantization: CheckpointQuant | None = None
    # How this run holds its projection and head weights (None: all in the run's float dtype);
    # set by the run's plan from --quantize and the checkpoint.
    weights: WeightPlan | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def with_layers(self, n: int) -> "ModelConfig":
        """Cut (or, for a preset, extend) the stack to n layers keeping the 3:1 pattern."""
        if n < 1:
            raise UsageError(f"--layers must be >= 1, got {n}")
        if n <= self.num_layers:
            types = self.layer_types[:n]
        else:
            types = hybrid_layer_types(n)
        return dataclasses.replace(self, layer_types=types)

    def to_hf_dict(self) -> dict:
        """The config.json an HF `qwen3_5_text` checkpoint of this shape carries."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_ids) or None,
            "dtype": self.checkpoint_dtype,
        }


# The names HF gives this model: the multimodal checkpoint's outer config, and its text config.
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)


def config_from_hf_dict(raw: dict, where: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config is not an object")
    # Another model's checkpoint may carry sizes enough to pass the checks below; its own name says
    # it is not this one. A config without the name (written by hand) is read by its fields.
    for config in (raw, text):
        kind = config.get("model_type")
        if kind is not None and kind not in MODEL_TYPES:
            raise ConfigError(f"{where}: model_type {kind!r} is not a model this engine runs ({', '.join(MODEL_TYPES)}: the dense Qwen3.5 hybrid decoder)")
    for key in _REQUIRED_INTS:
        value = text.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {key} is missing or not an integer (got {value!r})")
        if value <= 0:
            raise ConfigError(f"{where}: {key} must be positive, got {value}")
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {text['hidden_act']!r} is not supported (only silu)")
    num_layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:
        layer_types = hybrid_layer_types(num_layers)
    if not isinstance(layer_types, list | tuple) or len(layer_types) != num_layers:
        got = len(layer_types) if isinstance(layer_types, list | tuple) else layer_types
        raise ConfigError(f"{where}: layer_types has {got} entries, num_hidden_layers is {num_layers}")
    for i, kind in enumerate(layer_types):
        if kind not in LAYER_KINDS:
            raise ConfigError(f"{where}: layer_types[{i}] is {kind!r}; known kinds: {', '.join(LAYER_KINDS)}")
    # Optional fields have defaults, but a value that is present must make sense.
    for key in ("head_dim", "linear_conv_kernel_dim", "max_position_embeddings"):
        _check_positive(text.get(key), key, where, integer=True)
    _check_positive(text.get("rms_norm_eps"), "rms_norm_eps", where)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters is not an object (got {rope!r})")
    # Scaled variants (yarn, linear, dynamic, ...) change the rotary frequencies; they are not
    # built, and running them as plain rope would give other tokens without a word.
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported (only default rope; remove the scaling to run at the native context)")
    rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    _check_positive(rope_theta, "rope_theta", where)
    _check_positive(partial, "partial_rotary_factor", where)
    if partial > 1:
        raise ConfigError(f"{where}: partial_rotary_factor must be in (0, 1], got {partial}")
    # Grouped heads: each KV head (each GDN key head) serves a whole number of query (value) heads,
    # whatever the split.
    for many, few in (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads")):
        if text[many] % text[few]:
            raise ConfigError(f"{where}: {many}={text[many]} is not a multiple of {few}={text[few]}")
    eos_ids = eos_token_ids(text.get("eos_token_id", raw.get("eos_token_id")), text["vocab_size"], where)
    # A multimodal checkpoint's head is the outer model's, and transformers ties it by the outer
    # flag (saving a tied one, it writes its text_config's own default, false, beside it); the
    # text_config's is read only where the outer config has none.
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise ConfigError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    dtype = text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"
    quant = parse_quantization_config(text.get("quantization_config", raw.get("quantization_config")), where)
    return ModelConfig(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        layer_types=tuple(layer_types),
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=int(head_dim),
        linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(partial),
        max_position_embeddings=int(text.get("max_position_embeddings", 262_144)),
        tie_word_embeddings=bool(tie),
        eos_token_ids=eos_ids,
        checkpoint_dtype=str(dtype),
        quantization=quant,
    )


def _check_positive(value, key: str, where: str, integer: bool = False) -> None:
    """None (absent) passes; anything else must be a positive number (an integer if asked)."""
    if value is None:
        return
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise ConfigError(f"{where}: {key} must be a positive {'integer' if integer else 'number'}, got {value!r}")


def eos_token_ids(eos, vocab_size: int, where: str) -> tuple[int, ...]:
    """An `eos_token_id` field (one id, a list, or absent) as ids, each checked against the vocab."""
    ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    for e in ids:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab_size:
            raise ConfigError(f"{where}: eos_token_id must be token ids in [0, vocab_size={vocab_size}), got {eos!r}")
    return ids


def read_json(path: Path):
    """A checkpoint's JSON file, parsed; one line naming it when it cannot be read (a directory, a
    FIFO, which would block the read, or a link to nothing named for what it is) or is not JSON."""
    why = not_a_file(path)
    if why:
        raise ConfigError(f"{path} {why}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None


def load_config(ckpt_dir: Path) -> ModelConfig:
    path = Path(ckpt_dir) / "config.json"
    if not os.path.lexists(path):
        raise ConfigError(f"{path}: no config.json in the checkpoint directory")
    return config_from_hf_dict(read_json(path), where=str(path))


def valid_world_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    return [w for w in range(1, limit + 1) if not tp_split_problems(cfg, w)]


def tp_split_problems(cfg: ModelConfig, world: int) -> list[str]:
    """Each dimension that cannot be split over `world` ranks, as a phrase."""
    problems = []
    for name, value in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("linear_num_key_heads", cfg.linear_num_key_heads),
        ("linear_num_value_heads", cfg.linear_num_value_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if value % world:
            problems.append(f"{name}={value}")
    kv = cfg.num_key_value_heads
    # Fewer KV heads than ranks: each KV head is replicated on world // kv ranks, so kv must divide world.
    if (kv >= world and kv % world) or (kv < world and world % kv):
        problems.append(f"num_key_value_heads={kv}")
    return problems


def check_tp_split(cfg: ModelConfig, world: int) -> None:
    """world >= 1: model_plan refuses a smaller --tp-world before it gets here."""
    problems = tp_split_problems(cfg, world)
    if problems:
        valid = ", ".join(str(w) for w in valid_world_sizes(cfg, limit=max(64, world)))
        raise UsageError(
            f"cannot split the model over {world} ranks: {'; '.join(problems)} "
            f"not divisible by the world size; valid world sizes: {valid}"
        )

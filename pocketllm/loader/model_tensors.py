"""Every tensor a checkpoint of a model's shape holds, found in one walk down its layers: each
tensor's canonical name and shape, and for a projection (or the head), which a run may hold
quantized, whether its inputs are split over the ranks. The model check reads this one list for
each of its parts (the weight plan, the quantized split check, the checkpoint's validation), and a
preset's random weights are drawn in its shapes."""

from __future__ import annotations

from dataclasses import dataclass

from pocketllm.config import FULL, ModelConfig


@dataclass(frozen=True)
class ModelTensor:
    key: str  # the canonical name: model.layers.0..., lm_head.weight
    shape: tuple[int, ...]
    # A projection or the head: an [out, in] weight a run may hold quantized.
    projection: bool = False
    # Row-parallel: each rank holds some of its inputs (columns); column-parallel otherwise.
    row_parallel: bool = False


def model_tensors(cfg: ModelConfig) -> tuple[ModelTensor, ...]:
    """The model's tensors in the order a checkpoint of it is written."""
    h, heads, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hv, inter = cfg.linear_num_value_heads, cfg.intermediate_size
    out = [ModelTensor("model.embed_tokens.weight", (cfg.vocab_size, h)), ModelTensor("model.norm.weight", (h,))]
    if not cfg.tie_word_embeddings:
        out.append(ModelTensor("lm_head.weight", (cfg.vocab_size, h), projection=True))
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        out += [
            ModelTensor(f"{p}.input_layernorm.weight", (h,)),
            ModelTensor(f"{p}.post_attention_layernorm.weight", (h,)),
            ModelTensor(f"{p}.mlp.gate_proj.weight", (inter, h), projection=True),
            ModelTensor(f"{p}.mlp.up_proj.weight", (inter, h), projection=True),
            ModelTensor(f"{p}.mlp.down_proj.weight", (h, inter), projection=True, row_parallel=True),
        ]
        if kind == FULL:
            a = f"{p}.self_attn"
            out += [
                ModelTensor(f"{a}.q_proj.weight", (heads * d * 2, h), projection=True),
                ModelTensor(f"{a}.k_proj.weight", (kv * d, h), projection=True),
                ModelTensor(f"{a}.v_proj.weight", (kv * d, h), projection=True),
                ModelTensor(f"{a}.o_proj.weight", (h, heads * d), projection=True, row_parallel=True),
                ModelTensor(f"{a}.q_norm.weight", (d,)),
                ModelTensor(f"{a}.k_norm.weight", (d,)),
            ]
        else:
            a = f"{p}.linear_attn"
            out += [
                ModelTensor(f"{a}.in_proj_qkv.weight", (cfg.conv_dim, h), projection=True),
                ModelTensor(f"{a}.in_proj_z.weight", (cfg.linear_value_dim, h), projection=True),
                ModelTensor(f"{a}.in_proj_b.weight", (hv, h), projection=True),
                ModelTensor(f"{a}.in_proj_a.weight", (hv, h), projection=True),
                ModelTensor(f"{a}.conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)),
                ModelTensor(f"{a}.A_log", (hv,)),
                ModelTensor(f"{a}.dt_bias", (hv,)),
                ModelTensor(f"{a}.norm.weight", (cfg.linear_value_head_dim,)),
                ModelTensor(f"{a}.out_proj.weight", (h, cfg.linear_value_dim), projection=True, row_parallel=True),
            ]
    return tuple(out)


def projections(tensors) -> list[ModelTensor]:
    """The tensors a run may hold quantized, in the list's order."""
    return [t for t in tensors if t.projection]


def projection_keys(cfg: ModelConfig) -> dict[str, tuple[tuple[int, int], bool]]:
    """Every weight a run may hold quantized: key -> (full [out, in] shape, row-parallel)."""
    return {t.key: (t.shape, t.row_parallel) for t in projections(model_tensors(cfg))}

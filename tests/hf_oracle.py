"""Tiny random Qwen3_5ForCausalLM checkpoints written by transformers itself, with every norm and
gate parameter moved off its default so that a wrong formula cannot hide."""

from __future__ import annotations

from pathlib import Path

import torch

from pocketllm.bench import transformers_model


def build_hf_model(
    vocab: int = 251, kv_heads: int = 1, tie: bool = False, layers: int = 4, seed: int = 0, max_positions: int = 512,
    hidden: int = 64, head_dim: int = 16,
):
    """head_dim sizes the attention heads and the GDN's key and value heads alike; the MLP is
    twice `hidden` wide."""
    # The oracle runs on the CPU, where fla's kernels (a GPU machine's cuda extra) cannot.
    transformers_model.modeling(fla=False)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        eos_token_id=None,
        pad_token_id=None,
    )
    return _moved_off_defaults(Qwen3_5ForCausalLM(cfg).eval().float(), seed)


def build_hf_release_layout_model(seed: int = 0, tie: bool = False):
    """A tiny Qwen3_5ForConditionalGeneration, the class of the released checkpoints: the text model
    under model.language_model, a vision tower beside it (model.visual), multimodal rope sections
    in rope_parameters, and a config whose text part is its text_config. tie: the outer config's
    tie_word_embeddings, the flag this class reads (its text_config keeps its own default, false)."""
    # The oracle runs on the CPU, where fla's kernels (a GPU machine's cuda extra) cannot.
    transformers_model.modeling(fla=False)
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text_config = dict(
        vocab_size=251, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.1, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True},
    )
    vision_config = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                         spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen3_5Config(text_config=text_config, vision_config=vision_config, tie_word_embeddings=tie)
    return _moved_off_defaults(Qwen3_5ForConditionalGeneration(cfg).eval().float(), seed)


def _moved_off_defaults(model, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2.0 - 1.0)
    return model


def save_hf_checkpoint(model, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_prefill_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    # The mask given: without one, transformers infers it from pad_token_id and masks every id 0
    # in the prompt (the long prompts here hold some), so the reference would read another prompt.
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()

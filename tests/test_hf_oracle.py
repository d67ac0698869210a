"""transformers is the oracle: pocketllm's prefill logits and greedy tokens must match HF's
Qwen3_5ForCausalLM on the same safetensors checkpoint, at TP=1, 2 and 4 (the multi-rank runs sum
through the shared-memory all-reduce)."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (a declared test dependency: a broken install fails here, loudly)
from safetensors.torch import load_file

from conftest import generated_ids, run_cli
from hf_oracle import build_hf_model, hf_greedy, hf_prefill_logits, save_hf_checkpoint

PROMPT = [(7 * i + 3) % 200 for i in range(70)]
NEW_TOKENS = 16

CASES = {
    # vocab 251 is a multiple of neither 2 nor 4; one KV head is fewer than 2 or 4 ranks.
    "vocab251-kv1-untied": dict(vocab=251, kv_heads=1, tie=False),
    "vocab250-kv2-tied": dict(vocab=250, kv_heads=2, tie=True, seed=3),
}


@pytest.fixture(scope="module", params=list(CASES))
def oracle(request, tmp_path_factory):
    model = build_hf_model(**CASES[request.param])
    ckpt = save_hf_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return ckpt, hf_prefill_logits(model, PROMPT), hf_greedy(model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"tp{w}")
def test_logits_and_greedy_tokens_match_transformers(oracle, world, tmp_path):
    ckpt, ref_logits, ref_tokens = oracle
    logits_path = tmp_path / "logits.safetensors"
    r = run_cli(
        "generate", "--ckpt", ckpt, "--tp-world", world, "--dtype", "float32",
        "--token-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", NEW_TOKENS,
        "--logits-out", logits_path, "--dist-timeout", 30, *(["--collective", "shm"] if world > 1 else []),
    )
    assert r.returncode == 0, r.stderr
    logits = load_file(str(logits_path))["logits"]
    assert logits.shape == ref_logits.shape
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-3)
    assert generated_ids(r.stdout) == ref_tokens


LONG_PROMPT = [(13 * i + 5) % 250 for i in range(1100)]


def test_long_prompt_matches_transformers(tmp_path):
    # 1100 tokens take the paths short prompts never do: the conv's blocked multiply-adds, several
    # row blocks of the l2 norm, gated norm and activation, and more than one precompute block of
    # the chunked gated delta rule.
    model = build_hf_model(**CASES["vocab251-kv1-untied"], max_positions=2048)
    ckpt = save_hf_checkpoint(model, tmp_path / "ckpt")
    ref_logits, ref_tokens = hf_prefill_logits(model, LONG_PROMPT), hf_greedy(model, LONG_PROMPT, 4)
    logits_path = tmp_path / "logits.safetensors"
    r = run_cli(
        "generate", "--ckpt", ckpt, "--dtype", "float32", "--token-ids", ",".join(map(str, LONG_PROMPT)),
        "--max-new-tokens", 4, "--logits-out", logits_path,
    )
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(load_file(str(logits_path))["logits"], ref_logits, atol=2e-4, rtol=1e-3)
    assert generated_ids(r.stdout) == ref_tokens

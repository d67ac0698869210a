"""`pocketllm generate` runs of a small checkpoint of this model family that transformers wrote (the
oracle's), for the device tests that run the CLI: the prompt, the checkpoint, and a run's logits."""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import generated_ids, run_cli  # noqa: E402
from hf_oracle import build_hf_model, save_hf_checkpoint  # noqa: E402

PROMPT = [(7 * i + 3) % 200 for i in range(70)]
VOCAB = 251


def oracle_model():
    return build_hf_model(vocab=VOCAB, kv_heads=1)


def saved(model, folder: Path) -> Path:
    return save_hf_checkpoint(model, folder)


def generate_logits(ckpt, device: str, dtype: str, tmp_path, name: str, *flags):
    """(prompt logits [len(PROMPT), V], the 8 generated ids, stderr) of a generate run."""
    out = tmp_path / f"{name}.safetensors"
    r = run_cli("generate", "--ckpt", ckpt, "--device", device, "--dtype", dtype, "--token-ids", ",".join(map(str, PROMPT)),
                "--max-new-tokens", 8, "--logits-out", out, *flags, timeout=300)
    assert r.returncode == 0, r.stderr
    return load_file(str(out))["logits"], generated_ids(r.stdout), r.stderr

"""A checkpoint's generation_config.json, as HF writes it beside config.json: the ids that end an
answer (often more than config.json names: a chat model's end-of-turn and end-of-text), and the
sampling its authors recommend (temperature, top_p, top_k, min_p, repetition_penalty).

Every command stops at both files' eos ids. `serve` takes the sampling fields as the defaults of
a request that leaves them out, as vLLM's server does (`--generation-config none`: the API's own
defaults), and checks them as it checks a request's (serving/protocol.py); like vLLM it reads no
`do_sample`. Other fields (max_new_tokens, bos and pad ids) are not read. A broken file is one
line naming it, rather than defaults silently lost."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pocketllm.config import ConfigError, eos_token_ids, read_json

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    path: str = ""  # the file read ("" when the checkpoint has none)
    eos_token_ids: tuple[int, ...] = ()
    # The sampling fields the file sets, as a request would give them: (name, value) in file order.
    sampling: tuple[tuple[str, object], ...] = ()

    def describe(self) -> str:
        return ", ".join(f"{name}={value:g}" for name, value in self.sampling)


def read_generation_config(ckpt_dir, vocab_size: int) -> GenerationConfig:
    """The checkpoint's generation_config.json; an empty GenerationConfig when it has none."""
    path = Path(ckpt_dir) / FILE
    if not os.path.lexists(path):
        return GenerationConfig()
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    eos = eos_token_ids(raw.get("eos_token_id"), vocab_size, str(path))
    sampling = tuple((name, value) for name, value in raw.items() if name in SAMPLING_FIELDS and value is not None)
    return GenerationConfig(str(path), eos, sampling)


def merged_eos_ids(config_ids: tuple[int, ...], generation: GenerationConfig) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's others, each once."""
    return tuple(dict.fromkeys(config_ids + generation.eos_token_ids))

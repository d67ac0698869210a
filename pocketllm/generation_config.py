"""A checkpoint's generation_config.json, as HF writes it beside config.json: the ids that end an
answer (often more than config.json names: a chat model's end-of-turn and end-of-text), and the
sampling its authors recommend (temperature, top_p, top_k, min_p, repetition_penalty).

Every command stops at both files' eos ids. `serve` takes the sampling fields as the defaults of
a request that leaves them out, as vLLM's server does (`--generation-config none`: the API's own
defaults); like vLLM it reads no `do_sample`. Other fields (max_new_tokens, bos and pad ids) are
not read. A file that is present must be readable and make sense: a broken one is one line,
naming it, rather than defaults silently lost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pocketllm.config import read_json
from pocketllm.errors import UsageError

FILE = "generation_config.json"

# name -> (lowest, highest, whether the lowest is allowed): the ranges the serving API accepts.
SAMPLING_RANGES = {
    "temperature": (0.0, 2.0, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "repetition_penalty": (0.0, float("inf"), False),
}


class GenerationConfigError(UsageError):
    """generation_config.json is present and unreadable, or holds values no request could."""


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    # The sampling fields the file sets, as a request would give them: (name, value) in file order.
    sampling: tuple[tuple[str, float | int], ...] = ()

    def describe(self) -> str:
        return ", ".join(f"{name}={value:g}" for name, value in self.sampling)


def read_generation_config(ckpt_dir, vocab_size: int) -> GenerationConfig:
    """The checkpoint's generation_config.json; an empty GenerationConfig when it has none."""
    path = Path(ckpt_dir) / FILE
    if not path.is_file():
        return GenerationConfig()
    raw = read_json(path, GenerationConfigError)
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    for e in eos_ids:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab_size:
            raise GenerationConfigError(f"{path}: eos_token_id must be token ids in [0, vocab_size={vocab_size}), got {eos!r}")
    sampling = []
    for name, value in raw.items():
        if name == "top_k" and value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise GenerationConfigError(f"{path}: top_k must be an integer: -1 or 0 for every token, or k >= 1, got {value!r}")
            sampling.append((name, value))
        elif name in SAMPLING_RANGES and value is not None:
            lo, hi, lo_ok = SAMPLING_RANGES[name]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not (lo <= value if lo_ok else lo < value) or not value <= hi or value == float("inf"):
                bound = f"{'[' if lo_ok else '('}{lo:g}, {hi:g}]" if hi != float("inf") else f"> {lo:g}"
                raise GenerationConfigError(f"{path}: {name} must be a number {'in ' if hi != float('inf') else ''}{bound}, got {value!r}")
            sampling.append((name, float(value)))
    return GenerationConfig(eos_ids, tuple(sampling))


def merged_eos_ids(config_ids: tuple[int, ...], generation: GenerationConfig) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's others, each once."""
    return tuple(dict.fromkeys(config_ids + generation.eos_token_ids))

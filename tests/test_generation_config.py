"""A checkpoint's generation_config.json: its eos ids end what `generate` makes (beside
config.json's), serve refuses sampling fields no request could give, and a broken file is one line
naming it, exit 2. (serve's use of its sampling fields: tests/test_serve.py and
tests/test_serve_protocol.py.)"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from conftest import generated_ids, main_in_process, usage_error_in_process

from pocketllm.config import ConfigError
from pocketllm.generation_config import GenerationConfig, read_generation_config

PROMPT = "5,17,29,41,53"


def _generate(ckpt, *flags) -> list[int]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main_in_process("generate", "--ckpt", ckpt, "--dtype", "float32", "--token-ids", PROMPT, "--max-new-tokens", 12, *flags)
    assert rc == 0
    return generated_ids(out.getvalue())


def test_its_eos_ids_end_generate_beside_config_jsons(ckpt_copy):
    alone = _generate(ckpt_copy)
    # A token first chosen after a few others: the run must stop there, having chosen it.
    at = next(i for i, t in enumerate(alone) if i >= 3 and t not in alone[:i])
    (ckpt_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [alone[at]], "do_sample": True, "temperature": 0.7}))
    # Greedy still (generate takes none of its sampling fields), ending at the file's eos id.
    assert _generate(ckpt_copy) == alone[: at + 1]
    assert _generate(ckpt_copy, "--ignore-eos") == alone


def test_the_fields_read_and_the_ones_left(tmp_path):
    assert read_generation_config(tmp_path, 1000) == GenerationConfig()
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": 7, "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
        "max_new_tokens": 2048, "min_p": None,
    }))
    got = read_generation_config(tmp_path, 1000)
    assert got.eos_token_ids == (7,)
    assert got.sampling == (("temperature", 0.6), ("top_k", 20), ("top_p", 0.95))
    assert got.describe() == "temperature=0.6, top_k=20, top_p=0.95"


@pytest.mark.parametrize("content, message", [
    ("{\"temperature\": ", "invalid JSON"),
    ("[0.6]", "expected a JSON object"),
    (json.dumps({"eos_token_id": [2, 1000]}), "eos_token_id must be token ids in [0, vocab_size=1000), got [2, 1000]"),
    (json.dumps({"eos_token_id": True}), "eos_token_id must be token ids"),
])
def test_a_broken_file_is_one_line_naming_it(content, message, tmp_path, ckpt_copy, capsys, no_ranks):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ConfigError, match=r"generation_config\.json: ") as e:
        read_generation_config(tmp_path, 1000)
    assert message in str(e.value)
    (ckpt_copy / "generation_config.json").write_text(content)
    usage_error_in_process(capsys, "generate", "--ckpt", ckpt_copy, "--token-ids", PROMPT, "--device", "cpu", expect=(message, "generation_config.json"))


@pytest.mark.parametrize("fields, message", [
    ({"temperature": 3}, "temperature must be a number in [0, 2], got 3"),
    ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0 (1 is none), got 0"),
    ({"min_p": "0.1"}, "min_p must be a number in [0, 1], got '0.1'"),
])
def test_sampling_fields_serve_could_not_take_from_a_request_are_refused_at_its_start(fields, message, ckpt_copy, capsys, no_ranks):
    """serve checks the file's sampling fields as it checks a request's (the same code), before any
    rank starts."""
    (ckpt_copy / "generation_config.json").write_text(json.dumps(fields))
    usage_error_in_process(capsys, "serve", "--ckpt", ckpt_copy, "--port", 0, "--device", "cpu",
                           expect=(f"generation_config.json: {message}", "--generation-config none"))

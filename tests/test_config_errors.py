"""A corrupt or incomplete config.json, an unreadable tokenizer.json or a junk token-ids file is one
line naming the problem and exit 2, checked once before any work: by the launcher before it
starts a rank, and on rank 0 (which tells the others) when ranks are started by hand.

Most cases call the CLI in this process (no torch import per case) with subprocess.Popen made to
fail, which proves no rank is started; one case runs hand-started ranks for real."""

from __future__ import annotations

import json

import pytest

from conftest import assert_nothing_left, start, usage_error_in_process

PROMPT = "1,2,3,4,5,6,7,8"


def _set(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


CONFIG_CASES = {
    "invalid-json": ("{\"vocab_size\": 1000,", "invalid JSON"),
    "empty-file": ("", "invalid JSON"),
    "not-an-object": ("[1, 2]", "expected a JSON object"),
    "missing-hidden-size": (lambda cfg: cfg.pop("hidden_size"), "hidden_size is missing or not an integer (got None)"),
    "string-vocab": (_set("vocab_size", "1000"), "vocab_size is missing or not an integer (got '1000')"),
    "zero-heads": (_set("num_attention_heads", 0), "num_attention_heads must be positive, got 0"),
    "negative-intermediate": (_set("intermediate_size", -128), "intermediate_size must be positive, got -128"),
    "negative-head-dim": (_set("head_dim", -16), "head_dim must be a positive integer, got -16"),
    "zero-eps": (_set("rms_norm_eps", 0), "rms_norm_eps must be a positive number, got 0"),
    "rope-not-object": (_set("rope_parameters", "default"), "rope_parameters is not an object"),
    # Long-context scaling would change the rotary frequencies: run as plain rope, silently, it gave other tokens.
    "rope-yarn": (_set("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
                  "rope_type 'yarn' is not supported (only default rope"),
    "rope-scaling-linear": (lambda cfg: cfg.update(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}),
                            "rope_type 'linear' is not supported"),
    # A string is not a switch: "false" read as truthy ran the tied head and ignored lm_head.weight.
    "tie-a-string": (_set("tie_word_embeddings", "false"), "tie_word_embeddings must be true or false, got 'false'"),
    "layer-types-short": (lambda cfg: cfg.__setitem__("layer_types", cfg["layer_types"][:3]), "layer_types has 3 entries, num_hidden_layers is 4"),
    "layer-types-unknown": (lambda cfg: cfg["layer_types"].__setitem__(1, "mamba"), "layer_types[1] is 'mamba'; known kinds"),
    "layer-types-not-list": (_set("layer_types", "linear_attention"), "layer_types has linear_attention entries"),
    "kv-heads-not-dividing": (_set("num_key_value_heads", 3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    "eos-a-string": (_set("eos_token_id", "x"), "eos_token_id must be token ids in [0, vocab_size=1000), got 'x'"),
    "eos-past-the-vocab": (_set("eos_token_id", [1, 5000]), "eos_token_id must be token ids in [0, vocab_size=1000), got [1, 5000]"),
    "another-model": (_set("model_type", "qwen3_5_moe_text"), "model_type 'qwen3_5_moe_text' is not a model this engine runs (qwen3_5, qwen3_5_text"),
    "another-model-outside": (lambda cfg: _nest(cfg, "llava"), "model_type 'llava' is not a model this engine runs"),
}


def _nest(cfg: dict, outer_type: str) -> None:
    """cfg as the text config of a multimodal config named `outer_type`."""
    text = dict(cfg)
    cfg.clear()
    cfg.update(model_type=outer_type, text_config=text)


def corrupt(ckpt, change) -> None:
    path = ckpt / "config.json"
    if isinstance(change, str):
        path.write_text(change)
        return
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"tp{w}")
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_corrupt_config_is_one_line(case, world, ckpt_copy, capsys, no_ranks):
    change, message = CONFIG_CASES[case]
    corrupt(ckpt_copy, change)
    # --device cpu: at one rank this process is the rank, and must not bind a GPU it cannot unbind.
    usage_error_in_process(capsys, "generate", "--ckpt", ckpt_copy, "--token-ids", PROMPT, "--tp-world", world, "--device", "cpu", expect=(message, "config.json"))


@pytest.mark.timeout(30)
def test_unreadable_tokenizer_is_one_line(ckpt_copy, capsys, no_ranks):
    (ckpt_copy / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"')
    usage_error_in_process(capsys, "generate", "--ckpt", ckpt_copy, "--prompt", "hello", "--tp-world", 2, expect="tokenizer.json is not a readable tokenizer")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "content,message",
    [("1, 2, 3\n4 five 6\n", "'five' is not an integer token id"), (b"\xff\xfe\x00junk", "cannot read"), ("1 2 1e3", "'1e3' is not an integer")],
    ids=["word", "binary", "float"],
)
def test_junk_token_ids_file_is_one_line(content, message, tmp_path, capsys, no_ranks):
    f = tmp_path / "ids.txt"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids-file", f, "--tp-world", 2, expect=message)


@pytest.mark.timeout(60)
def test_hand_started_ranks_agree_on_rank0_verdict(ckpt_copy, tmp_path):
    """Rank 1 does not check the inputs itself: rank 0 stops at once with its verdict, before the
    rendezvous (it waited there for rank 1 first), and rank 1 stops with it, naming rank 0."""
    corrupt(ckpt_copy, CONFIG_CASES["layer-types-unknown"][0])
    id_path = tmp_path / "run.id"
    # A rank 1 left waiting would end only at its 45 s timeout, well past the bound below.
    args = ["generate", "--ckpt", ckpt_copy, "--token-ids", PROMPT, "--tp-world", 2, "--rendezvous-file", id_path, "--dist-timeout", 45]
    runs = [start(*args, "--tp-rank", r, tmp_path=tmp_path) for r in (0, 1)]
    assert [r.wait() for r in runs] == [2, 2], runs[0].stderr + runs[1].stderr
    lines0 = runs[0].stderr.strip().splitlines()
    assert len(lines0) == 1 and "layer_types[1] is 'mamba'" in lines0[0], runs[0].stderr
    verdict = lines0[0].removeprefix("pocketllm: error: ")
    assert runs[1].stderr.strip() == f"pocketllm: error: rank 0 stopped before the rendezvous at --rendezvous-file {id_path}: {verdict}", runs[1].stderr
    assert max(r.ended for r in runs) - min(r.started for r in runs) < 30
    assert not id_path.exists()
    for r in runs:
        assert_nothing_left(r)


def test_a_rank_past_the_hosts_devices_is_one_line(monkeypatch):
    """More ranks on a host than it has GPUs: one line naming the device and the count, where
    torch would raise "invalid device ordinal" from inside (a --device index past the count is
    refused when the run is planned: test_input_errors.py)."""
    import torch

    from pocketllm import device
    from pocketllm.errors import UsageError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail(f"bound cuda:{index}"))
    with pytest.raises(UsageError, match=r"^local rank 3 of 4 would take cuda:3, but this host shows 2 cuda device\(s\): run at most 2 ranks on it$"):
        device.setup_device("cuda", None, local_rank=3, world=4)

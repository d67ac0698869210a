"""A broken checkpoint is reported by name, in one line, with exit code 2, before any rank starts;
the layouts real releases use (nested text weights, sharded files, mtp/vision extras) load.

The cases call the CLI in this process: the broken checkpoints at two ranks or more, where the
launcher checks the checkpoint before it would start a rank (no_ranks fails the test if one is
started), the layouts that load at one rank. The absent shard is checked at the default single
rank by `python -m pocketllm` for real, so the exit status and the clean stderr of an actual
process stay covered."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_usage_error, generated_ids, main_in_process, run_cli, usage_error_in_process

PROMPT = "1,2,3,4,5,6,7,8"


def generated_in_process(capsys, *source) -> list[int]:
    """generate's ids for a model source (`--ckpt DIR` or `--preset ...`), run in this process."""
    capsys.readouterr()
    rc = main_in_process("generate", *source, "--token-ids", PROMPT, "--max-new-tokens", 4, "--dtype", "float32")
    out = capsys.readouterr()
    assert rc == 0, out.err
    return generated_ids(out.out)


def generate_error(capsys, ckpt, *extra, world=2, expect=()) -> str:
    """generate's one-line usage error, holding every `expect` fragment, from a call in this
    process (use with no_ranks)."""
    return usage_error_in_process(
        capsys, "generate", "--ckpt", ckpt, "--token-ids", PROMPT, "--max-new-tokens", 4, "--dtype", "float32", "--tp-world", world, *extra,
        expect=expect,
    )


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    """The tiny preset at 24 layers in 1 MiB shards. Module scope: made before any no_ranks test
    stops this process from starting one, and once for the tests that copy it."""
    out = tmp_path_factory.mktemp("sharded")
    assert main_in_process("make-checkpoint", "--preset", "tiny", "--layers", "24", "--out", out, "--max-shard-mib", 1) == 0
    return out


@pytest.fixture
def sharded(sharded_ckpt, tmp_path):
    """A private copy of the sharded checkpoint, for a test to break."""
    dst = tmp_path / "sharded"
    shutil.copytree(sharded_ckpt, dst)
    return dst


def rewrite(ckpt, change):
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_missing_directory(tmp_path, capsys, no_ranks):
    generate_error(capsys, tmp_path / "nowhere", expect=("nowhere", "does not exist"))


def test_a_file_given_as_the_checkpoint_is_named(tiny_ckpt, capsys, no_ranks):
    generate_error(capsys, tiny_ckpt / "config.json", expect=("config.json is not a directory",))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "generation_config.json"])
@pytest.mark.parametrize("what", ["a directory", "a link to nothing", "a FIFO"])
def test_a_checkpoint_file_that_is_no_file_says_what_it_is(ckpt_copy, name, what, capsys, no_ranks):
    """A checkpoint's file replaced by something that cannot be read as one is named for what it
    is, not said to be absent (and a FIFO is never opened: a read would block)."""
    path = ckpt_copy / name
    path.unlink(missing_ok=True)
    if what == "a directory":
        path.mkdir()
        expect = f"{path} is a directory"
    elif what == "a link to nothing":
        path.symlink_to(ckpt_copy / "gone")
        expect = f"{path} is a symbolic link to {ckpt_copy / 'gone'}, which does not exist"
    else:
        os.mkfifo(path)
        expect = f"{path} is not a regular file"
    if name == "tokenizer.json":
        line = usage_error_in_process(capsys, "generate", "--ckpt", ckpt_copy, "--prompt", "hi", "--max-new-tokens", 1)
        assert f"--prompt needs {expect.replace(f'{path} is', f'{path}, which is')}" in line, line
    else:
        generate_error(capsys, ckpt_copy, expect=expect)


def test_missing_tensor_named(ckpt_copy, capsys, no_ranks):
    rewrite(ckpt_copy, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    generate_error(capsys, ckpt_copy, expect=("missing 1 tensor", "model.layers.1.linear_attn.A_log"))


def test_unexpected_tensor_named(ckpt_copy, capsys, no_ranks):
    rewrite(ckpt_copy, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(2, 2)))
    generate_error(capsys, ckpt_copy, expect=("unexpected 1 tensor", "model.layers.0.mlp.extra_proj.weight"))


def test_layers_cut_by_the_flag_are_left_unread(ckpt_copy, capsys):
    """--layers 2 leaves the checkpoint's last two layers unread, as asked: the run is the preset's
    at two layers (the tiny checkpoint holds the tiny preset's weights)."""
    assert generated_in_process(capsys, "--ckpt", ckpt_copy, "--layers", 2) == generated_in_process(capsys, "--preset", "tiny", "--layers", 2)


def test_layers_past_what_the_config_declares_are_unexpected(ckpt_copy, capsys, no_ranks):
    # A config.json that declares two layers of the four the weights hold is wrong, not a cut.
    path = ckpt_copy / "config.json"
    cfg = json.loads(path.read_text())
    assert cfg["num_hidden_layers"] == 4
    path.write_text(json.dumps({**cfg, "num_hidden_layers": 2, "layer_types": cfg["layer_types"][:2]}))
    generate_error(capsys, ckpt_copy, expect=("unexpected", "model.layers.2."))


def test_shape_mismatch_named(ckpt_copy, capsys, no_ranks):
    rewrite(ckpt_copy, lambda t: t.__setitem__("model.norm.weight", torch.zeros(63)))
    generate_error(capsys, ckpt_copy, expect="model.norm.weight has shape [63], expected [64]")


def test_dtype_mismatch_named(ckpt_copy, capsys, no_ranks):
    rewrite(ckpt_copy, lambda t: t.__setitem__("model.norm.weight", torch.zeros(64, dtype=torch.int32)))
    generate_error(capsys, ckpt_copy, expect="model.norm.weight has dtype I32")


def test_truncated_file_named(ckpt_copy, capsys, no_ranks):
    path = ckpt_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    generate_error(capsys, ckpt_copy, expect="model.safetensors is truncated or corrupt")


def test_sharded_checkpoint_loads_as_the_preset_runs_and_absent_shard_is_named(sharded, capsys):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    # total_size as HF writes it: the tensors' bytes (each shard's file less its header).
    headers = [8 + int.from_bytes((sharded / s).read_bytes()[:8], "little") for s in shards]
    assert index["metadata"]["total_size"] == sum((sharded / s).stat().st_size - h for s, h in zip(shards, headers))
    direct = generated_in_process(capsys, "--preset", "tiny", "--layers", "24")
    assert generated_in_process(capsys, "--ckpt", sharded) == direct
    (sharded / shards[-1]).unlink()
    r = run_cli("generate", "--ckpt", sharded, "--token-ids", PROMPT, "--max-new-tokens", 4, "--dtype", "float32")
    assert_usage_error(r, "absent", shards[-1])
    # There, but no file: named for what it is.
    (sharded / shards[-1]).mkdir()
    usage_error_in_process(capsys, "generate", "--ckpt", sharded, "--token-ids", PROMPT, "--max-new-tokens", 4,
                           expect=f"names shard(s) that are no file to read: {shards[-1]} (is a directory)")


def test_a_single_file_beside_an_index_is_read_as_transformers_reads_it_and_the_run_says_so(sharded, tmp_path, capsys):
    """A directory holding both model.safetensors and an index (one of them left from an earlier
    save) is read as transformers reads it: the single file. Here it holds other weights than the
    shards, so the tokens show which was read."""
    from_shards = generated_in_process(capsys, "--ckpt", sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(sharded / shard)))
    tensors["model.norm.weight"] = -3 * tensors["model.norm.weight"] - 1
    alone = tmp_path / "alone"
    alone.mkdir()
    for f in sharded.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, alone / f.name)
    save_file(tensors, str(alone / "model.safetensors"))
    from_single = generated_in_process(capsys, "--ckpt", alone)
    assert from_single != from_shards
    shutil.copy2(alone / "model.safetensors", sharded / "model.safetensors")
    capsys.readouterr()
    assert main_in_process("generate", "--ckpt", sharded, "--token-ids", PROMPT, "--max-new-tokens", 4, "--dtype", "float32") == 0
    out = capsys.readouterr()
    assert generated_ids(out.out) == from_single
    assert f"note: {sharded} holds both model.safetensors and model.safetensors.index.json: reading model.safetensors" in out.err, out.err


def test_an_fp32_checkpoint_of_a_preset_holds_the_presets_weights(tmp_path, capsys):
    """A preset's weights are bf16 values whatever dtype a run holds them in; make-checkpoint
    writes those values at --dtype float32 too, so the checkpoint runs as the preset does."""
    out = tmp_path / "fp32"
    assert main_in_process("make-checkpoint", "--preset", "tiny", "--dtype", "float32", "--out", out) == 0
    assert generated_in_process(capsys, "--ckpt", out) == generated_in_process(capsys, "--preset", "tiny")


def test_nested_multimodal_layout_loads_and_skips_extras(tiny_ckpt, tmp_path, capsys):
    """text_config nesting, `model.language_model.` names, and mtp/vision weights that are skipped."""
    nested = tmp_path / "nested"
    nested.mkdir()
    tensors = load_file(str(tiny_ckpt / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()}
    renamed["mtp.fc.weight"] = torch.zeros(3, 3)
    renamed["model.visual.patch_embed.weight"] = torch.zeros(3, 3)
    save_file(renamed, str(nested / "model.safetensors"))
    flat = json.loads((tiny_ckpt / "config.json").read_text())
    # The outer flag is the one read (transformers' multimodal class ties by it): as transformers
    # writes it, the text_config's says otherwise.
    outer = {"model_type": "qwen3_5", "text_config": {**flat, "tie_word_embeddings": False}, "tie_word_embeddings": flat["tie_word_embeddings"]}
    (nested / "config.json").write_text(json.dumps(outer))
    assert generated_in_process(capsys, "--ckpt", nested) == generated_in_process(capsys, "--ckpt", tiny_ckpt)


def test_layers_cut_beyond_checkpoint(tiny_ckpt, capsys, no_ranks):
    generate_error(capsys, tiny_ckpt, "--layers", 9, expect=("--layers 9", "only 4 layers"))


def test_unsplittable_world_names_dimension_and_valid_sizes(tiny_ckpt, capsys, no_ranks):
    generate_error(capsys, tiny_ckpt, world=3, expect=("over 3 ranks", "num_attention_heads=4", "valid world sizes: 1, 2, 4"))


def test_index_key_in_the_wrong_shard_is_named(sharded, capsys, no_ranks):
    path = sharded / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    weight_map = index["weight_map"]
    wrong = next(f for f in sorted(set(weight_map.values())) if f != weight_map["model.norm.weight"])
    weight_map["model.norm.weight"] = wrong
    path.write_text(json.dumps(index))
    generate_error(capsys, sharded, expect=("model.norm.weight", f"not in {wrong}"))


@pytest.mark.parametrize("weight_map,expect", [
    ([1, 2], "weight_map must map each tensor name to a shard's file name"),
    ({"model.norm.weight": 3}, "weight_map must map each tensor name to a shard's file name"),
    ({"model.norm.weight": "../elsewhere.safetensors"}, "outside the checkpoint directory: ../elsewhere.safetensors"),
    ({"model.norm.weight": "/etc/passwd"}, "outside the checkpoint directory: /etc/passwd"),
], ids=["a-list", "a-number", "up-a-level", "absolute"])
def test_an_index_of_the_wrong_form_is_named(sharded, weight_map, expect, capsys, no_ranks):
    path = sharded / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    generate_error(capsys, sharded, expect=(str(path), expect))

"""Weight-only quantization of a whole model: a quantized run multiplies exactly the dequantized
weights, its error against the unquantized model is bounded, TP=2 and TP=4 give TP=1's tokens,
and a checkpoint written quantized (`pocketllm quantize`, `make-checkpoint --quantize`) gives
the tokens `--quantize` gives at load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import cli_env, feed, generated_ids, main_in_process, run_cli, usage_error_in_process

from pocketllm.distributed.policy import RulePolicy
from pocketllm.distributed.state import set_tp
from pocketllm.engine.runner import Engine
from pocketllm.loader.model_tensors import projection_keys
from pocketllm.loader.random_weights import RandomWeights, random_row_blocks, random_tensor
from pocketllm.ops.quant.layout import QuantizedWeight, dequantize, quantize
from pocketllm.presets import get_preset
from pocketllm.quantization import WeightPlan, parse_scheme

IDS = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(0))


class _Dequantized(RandomWeights):
    """The preset's weights with every projection and head replaced by its quantization,
    dequantized: the float model a quantized run must equal."""

    def __init__(self, cfg, scheme):
        super().__init__(cfg)
        self.scheme, self.keys = scheme, projection_keys(cfg)

    def get_slice(self, name):
        sl = super().get_slice(name)
        if name not in self.keys:
            return sl
        return dequantize(quantize(sl[:], self.scheme.kind, self.scheme.group, self.scheme.symmetric))


def _logits(cfg, source, held: list | None = None) -> torch.Tensor:
    set_tp(0, 1)
    engine = Engine(cfg, source, torch.float32, torch.device("cpu"), RulePolicy())
    if held is not None:
        held += engine.model.projection_weights()
    engine.reserve_slots(1, len(IDS))
    return feed(engine, IDS, all_logits=True)


def _quantized(scheme_name: str):
    cfg = get_preset("tiny")
    return dataclasses.replace(cfg, weights=WeightPlan(parse_scheme(scheme_name)))


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_a_quantized_run_multiplies_exactly_the_dequantized_weights(scheme):
    cfg, held = _quantized(scheme), []
    got = _logits(cfg, RandomWeights(cfg), held)
    assert held and all(isinstance(w, QuantizedWeight) for w in held)
    want = _logits(get_preset("tiny"), _Dequantized(get_preset("tiny"), parse_scheme(scheme)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_whole_model_error_against_the_unquantized_model_is_bounded():
    """Figures on this random preset are far above a trained model's (docs/quantization.md): the
    bounds hold each scheme near its measured error and keep int8 well ahead of int4."""
    ref = _logits(get_preset("tiny"), RandomWeights(get_preset("tiny")))
    p = torch.log_softmax(ref, -1)

    def errors(scheme):
        cfg = _quantized(scheme)
        got = _logits(cfg, RandomWeights(cfg))
        kl = (p.exp() * (p - torch.log_softmax(got, -1))).sum(-1).mean().item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        return ((got - ref).norm() / ref.norm()).item(), kl, top1

    int8, int4 = errors("int8"), errors("int4-g32-asym")
    other = _logits(get_preset("tiny"), RandomWeights(get_preset("tiny"), seed=1))
    unrelated = ((other - ref).norm() / ref.norm()).item()
    assert int8[0] < 0.15 and int8[1] < 0.005 and int8[2] >= 0.8, int8
    assert int4[0] < 0.9 and int4[1] < 0.1, int4
    assert int8[0] < int4[0] / 4 and int4[0] < unrelated, (int8, int4, unrelated)


def _generate(*argv, world: int = 1) -> list[int]:
    args = ["generate", "--preset", "tiny", "--dtype", "float32", "--token-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "12", *argv]
    if world == 1:
        import io
        from contextlib import redirect_stdout

        out = io.StringIO()
        with redirect_stdout(out):
            assert main_in_process(*args) == 0
        return generated_ids(out.getvalue())
    r = run_cli(*args, "--tp-world", world, timeout=240, env=cli_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return generated_ids(r.stdout)


def test_tensor_parallel_runs_give_tp1s_tokens():
    """int8 is the scheme whose row-parallel shards need the ranks to agree (the row maximum)."""
    one = _generate("--quantize", "int8")
    for world in (2, 4):
        assert _generate("--quantize", "int8", world=world) == one, world


@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g32-asym"])
def test_an_int4_row_parallel_shard_is_the_slice_of_the_whole_matrix(scheme):
    from pocketllm.loader.quantized import read_quantized

    s = parse_scheme(scheme)
    source = RandomWeights(get_preset("tiny"))
    key = "model.layers.0.mlp.down_proj.weight"  # [64, 128]: row-parallel over its 128 inputs
    whole = dequantize(read_quantized(source, key, (64, 128), [(0, 64)], None, s))
    for world in (2, 4):
        local = 128 // world
        for rank in range(world):
            part = read_quantized(source, key, (64, 128), None, (rank * local, (rank + 1) * local), s)
            assert torch.equal(dequantize(part), whole[:, rank * local : (rank + 1) * local]), (world, rank)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_off_a_cpu_each_quantized_weight_is_placed_dequantized_in_the_run_dtype_and_freed_from_the_host(scheme, monkeypatch):
    """The quantized kernels are CPU code: on another device the loader places each quantized
    weight as its dequantized values in the run's dtype (here on `meta`, which holds shapes and
    dtypes alone), and each host weight is freed once it is placed, so the host holds the
    quantized model one weight at a time."""
    import gc
    import weakref

    from pocketllm.loader import load, quantized
    from pocketllm.models.qwen3_5 import Qwen35ForCausalLM

    set_tp(0, 1)
    cfg = dataclasses.replace(get_preset("tiny"), weights=WeightPlan(parse_scheme(scheme)))
    model = Qwen35ForCausalLM(cfg, torch.bfloat16, torch.device("meta"))
    host = [weakref.ref(w.qweight) for w in model.projection_weights() if isinstance(w, QuantizedWeight)]
    alive = []

    def placing(qw, dtype, device):
        alive.append(sum(ref() is not None for ref in host))
        return quantized.for_device(qw, dtype, device)

    monkeypatch.setattr(load, "for_device", placing)
    load.load_weights(model, RandomWeights(cfg))
    gc.collect()
    assert len(host) == len(model.projections()) and alive == list(range(len(host), 0, -1))
    assert not any(ref() is not None for ref in host)
    for weight in model.projection_weights():
        assert weight.dtype == torch.bfloat16 and weight.is_meta


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_a_weight_dequantized_on_a_device_a_block_of_rows_at_a_time_is_dequantize_in_the_run_dtype(scheme, monkeypatch):
    from pocketllm.loader import quantized

    s = parse_scheme(scheme)
    qw = quantize(random_tensor("w", (19, 64), seed=3), s.kind, s.group, s.symmetric)
    monkeypatch.setattr(quantized, "DEQUANTIZE_ROWS", 8)
    placed = quantized.dequantized_on(qw, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(placed, dequantize(qw).to(torch.bfloat16))


def test_a_packed_checkpoint_gives_the_tokens_of_quantizing_at_load(tiny_ckpt, tmp_path, capsys):
    for scheme in ("int8", "int4-g32-asym"):
        out = tmp_path / scheme
        assert main_in_process("quantize", "--ckpt", tiny_ckpt, "--out", out, "--scheme", scheme) == 0
        made = tmp_path / f"made-{scheme}"
        assert main_in_process("make-checkpoint", "--preset", "tiny", "--out", made, "--quantize", scheme) == 0
        capsys.readouterr()
        at_load = _generate("--quantize", scheme)
        assert (tmp_path / scheme / "tokenizer.json").is_file()
        for ckpt in (out, made):
            args = ["generate", "--ckpt", ckpt, "--dtype", "float32", "--token-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "12"]
            assert main_in_process(*args) == 0
            captured = capsys.readouterr()
            assert generated_ids(captured.out) == at_load, (scheme, ckpt)
            assert f"weights {scheme} (as stored, compressed-tensors)" in captured.err


def test_quantize_usage_errors(no_ranks, capsys, tiny_ckpt, tmp_path):
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--quantize", "int3", "--token-ids", "1", expect=("--quantize 'int3'", "int4-g64-asym"))
    usage_error_in_process(
        capsys, "generate", "--preset", "tiny", "--quantize", "int4-g32", "--tp-world", "4", "--token-ids", "1",
        expect=("--quantize int4-g32 at --tp-world 4:", "o_proj", "16 of its 64 inputs", "groups of 32"),
    )
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--quantize", "int4-g128", "--token-ids", "1", expect=("64 inputs", "int4-g32, int4-g64"))
    # The flag as given, and what plain int4 means.
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--quantize", "int4", "--token-ids", "1", expect=("--quantize int4 (int4-g128): ", "64 inputs"))
    usage_error_in_process(capsys, "quantize", "--ckpt", tiny_ckpt, "--out", tmp_path / "g128", "--scheme", "int4", expect=("--scheme int4 (int4-g128): ",))
    packed = tmp_path / "q"
    assert main_in_process("quantize", "--ckpt", tiny_ckpt, "--out", packed, "--scheme", "int8") == 0
    capsys.readouterr()
    usage_error_in_process(capsys, "generate", "--ckpt", packed, "--quantize", "int4", "--token-ids", "1", expect=("stored quantized (int8)",))
    usage_error_in_process(capsys, "quantize", "--ckpt", packed, "--out", tmp_path / "again", "--scheme", "int4", expect=("already quantized",))
    usage_error_in_process(capsys, "quantize", "--ckpt", tiny_ckpt, "--out", tmp_path / "x", "--scheme", "none", expect=("--scheme none",))
    # The schemes it lists are the ones it takes: none is not one here.
    line = usage_error_in_process(capsys, "quantize", "--ckpt", tiny_ckpt, "--out", tmp_path / "x", "--scheme", "int5", expect=("'int5' is not a scheme: use int8,",))
    assert "none" not in line


def test_a_broken_packed_checkpoint_is_named(tiny_ckpt, tmp_path, capsys, no_ranks):
    from safetensors.torch import load_file, save_file

    packed = tmp_path / "q"
    assert main_in_process("quantize", "--ckpt", tiny_ckpt, "--out", packed, "--scheme", "int4-g32") == 0
    capsys.readouterr()
    tensors = load_file(packed / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight_packed"
    tensors[key] = tensors[key][:, :-1].contiguous()
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, packed / "model.safetensors")
    usage_error_in_process(capsys, "generate", "--ckpt", packed, "--token-ids", "1", expect=(key, "up_proj.weight_scale"))


def test_random_weights_in_row_blocks_are_the_whole_tensor():
    for name, shape in (("model.embed_tokens.weight", (1000, 64)), ("model.layers.0.mlp.down_proj.weight", (3000, 40))):
        whole = random_tensor(name, shape, 0)
        assert torch.equal(torch.cat([b for _, b in random_row_blocks(name, shape, 0, 256)]), whole)


def _fp8_release(src, out, keep=("lm_head", "in_proj_a", "in_proj_b")):
    """The checkpoint in Qwen's FP8 release format: projections e4m3 with 128x128 block scales,
    the modules named in `keep` (and norms, embeddings, conv) left in bf16."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from pocketllm.loader.fp8 import to_fp8_blocks

    out.mkdir()
    tensors, written = load_file(src / "model.safetensors"), {}
    keys = projection_keys(get_preset("tiny"))
    for name, t in tensors.items():
        if name in keys and not any(k in name for k in keep):
            written[name], written[name + "_scale_inv"] = to_fp8_blocks(t)
        else:
            written[name] = t
    save_file(written, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": list(keep)}
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    return written



class _TensorSlice:
    """A tensor behind safetensors' slice interface (get_shape, indexing), as the loader reads one."""

    def __init__(self, t):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, i):
        return self.t[i]


def test_an_fp8_release_checkpoint_loads_converted(tiny_ckpt, tmp_path, capsys):
    from safetensors.torch import save_file

    fp8 = tmp_path / "fp8"
    written = _fp8_release(tiny_ckpt, fp8)
    # The same weights as fp32 floats: what `--quantize none` must run exactly.
    from pocketllm.loader.fp8 import Fp8Slice

    floats = tmp_path / "floats"
    floats.mkdir()
    plain = {k: (Fp8Slice(_TensorSlice(v), _TensorSlice(written[k + "_scale_inv"]), (128, 128))[:] if k + "_scale_inv" in written else v.float()) for k, v in written.items() if not k.endswith("_scale_inv")}
    save_file(plain, str(floats / "model.safetensors"))
    (floats / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    base = ["generate", "--dtype", "float32", "--token-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "12"]
    capsys.readouterr()
    assert main_in_process(*base, "--ckpt", fp8, "--quantize", "none") == 0
    assert main_in_process(*base, "--ckpt", floats) == 0
    none, want = [line for line in capsys.readouterr().out.splitlines() if line.startswith("generated_ids")]
    assert none == want
    assert main_in_process(*base, "--ckpt", fp8) == 0
    captured = capsys.readouterr()
    assert "weights int8 (converted from the fp8 checkpoint at load; 7 kept unquantized)" in captured.err.splitlines(), captured.err
    one = generated_ids(captured.out)
    # Quantizing the release to a file gives the tokens of converting it at load.
    packed = tmp_path / "packed"
    assert main_in_process("quantize", "--ckpt", fp8, "--out", packed, "--scheme", "int8") == 0
    capsys.readouterr()
    assert main_in_process(*base, "--ckpt", packed) == 0
    assert generated_ids(capsys.readouterr().out) == one


def test_an_fp8_release_loads_as_its_floats_off_a_cpu_unless_asked(tiny_ckpt, tmp_path):
    """A device runs quantized weights dequantized: int8 on the way from fp8 would add its rounding
    to fp8's and save nothing, so off a CPU the release's default is its values as floats."""
    from pocketllm.loader.checkpoint import CheckpointReader
    from pocketllm.loader.checks import UNSET, plan_weights
    from pocketllm.loader.model_tensors import model_tensors
    from pocketllm.model_args import checkpoint_config

    _fp8_release(tiny_ckpt, tmp_path / "fp8")
    cfg, _ = checkpoint_config(str(tmp_path / "fp8"), None)
    reader = CheckpointReader(str(tmp_path / "fp8"))
    plan = lambda requested, kind: plan_weights(cfg, reader, requested, model_tensors(cfg), kind)  # noqa: E731
    assert plan(UNSET, "cpu").formats() == ["int8"]
    for kind in ("cuda", "npu"):
        assert plan(UNSET, kind) is None
        assert plan(parse_scheme("int4-g32"), kind).formats() == ["int4-g32"]
    reader.close()


def test_an_fp8_weight_without_its_scales_is_named(tiny_ckpt, tmp_path, capsys):
    from safetensors.torch import save_file

    from conftest import usage_error_in_process

    fp8 = tmp_path / "fp8"
    written = _fp8_release(tiny_ckpt, fp8)
    lost = next(k for k in sorted(written) if k.endswith("_scale_inv"))
    del written[lost]
    save_file(written, str(fp8 / "model.safetensors"))
    weight = lost.removesuffix("_scale_inv")
    usage_error_in_process(capsys, "generate", "--ckpt", fp8, "--token-ids", "1,2,3", "--max-new-tokens", "2",
                           expect=(f"{weight} is fp8 (F8_E4M3) without its scales: {lost} is missing",))


def test_an_fp8_slice_reads_any_rows_or_columns_across_blocks():
    from pocketllm.loader.fp8 import Fp8Slice, to_fp8_blocks

    torch.manual_seed(3)
    q, scale = to_fp8_blocks(torch.randn(10, 20), (4, 8))
    assert scale.shape == (3, 3)
    whole = q.float() * scale.repeat_interleave(4, 0)[:10].repeat_interleave(8, 1)[:, :20]
    sl = Fp8Slice(_TensorSlice(q), _TensorSlice(scale), (4, 8))
    for index in (slice(None), slice(3, 9)):
        assert torch.equal(sl[index], whole[index])
    assert torch.equal(sl[:, 5:17], whole[:, 5:17]) and torch.equal(sl[2:7, 9:20], whole[2:7, 9:20])


def test_a_checkpoint_that_left_some_parts_of_a_fused_projection_float_runs_them_float(tiny_ckpt, tmp_path, capsys):
    """An ignore list naming in_proj_b/in_proj_a (as recipes for this model's fused GDN
    projection do): those parts stay float, the rest of the fused weight is quantized."""
    import json

    from safetensors.torch import load_file, save_file

    from pocketllm.loader.checkpoint import CheckpointReader

    packed = tmp_path / "q"
    assert main_in_process("quantize", "--ckpt", tiny_ckpt, "--out", packed, "--scheme", "int8") == 0
    floats, tensors = load_file(tiny_ckpt / "model.safetensors"), load_file(packed / "model.safetensors")
    kept = [k for k in floats if k.endswith(("in_proj_a.weight", "in_proj_b.weight"))]
    for key in kept:
        for suffix in ("_packed", "_scale", "_shape"):
            del tensors[key + suffix]
        tensors[key] = floats[key]
    save_file(tensors, str(packed / "model.safetensors"))
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["re:.*in_proj_[ab]$"]
    (packed / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    cfg = get_preset("tiny")
    plan = WeightPlan(parse_scheme("int8"), overrides=tuple((k, None) for k in kept))
    want = _logits(dataclasses.replace(cfg, weights=plan), RandomWeights(cfg))
    from pocketllm.config import load_config
    from pocketllm.loader.model_tensors import model_tensors
    from pocketllm.loader.checks import UNSET, plan_weights

    reader = CheckpointReader(packed)
    loaded = load_config(packed)
    loaded = dataclasses.replace(loaded, weights=plan_weights(loaded, reader, UNSET, model_tensors(loaded)))
    held = []
    got = _logits(loaded, reader, held)
    assert sum(isinstance(w, torch.Tensor) for w in held) == len(kept) // 2  # one float block per GDN layer
    torch.testing.assert_close(got, want, rtol=0, atol=0)

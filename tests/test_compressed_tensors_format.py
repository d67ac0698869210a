"""The compressed-tensors pack-quantized layout against the compressed-tensors package itself (the
test extra installs it; the engine never imports it): what pocketllm writes, the package reads back
as the same weights, and what the package writes, pocketllm reads back as the package does."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pocketllm.loader.compressed_tensors import read_packed, to_packed
from pocketllm.ops.quant.layout import dequantize, quantize, unpack_int4
from pocketllm.quantization import WeightScheme

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402


class _File:
    def __init__(self, path):
        self.f = safe_open(str(path), "pt")

    def get_slice(self, key):
        return self.f.get_slice(key)


# Row counts that are not multiples of 8 pad the zero points' last packed word.
CASES = [(WeightScheme(4, 32, False), 12), (WeightScheme(4, 64, False), 40), (WeightScheme(4, 128), 24), (WeightScheme(8), 20)]


@pytest.mark.parametrize("scheme, rows", CASES, ids=[f"{s.name}-{r}" for s, r in CASES])
def test_packing_matches_the_package_both_ways(scheme, rows, tmp_path):
    torch.manual_seed(0)
    w = torch.randn(rows, 256, dtype=torch.bfloat16)
    qw = quantize(w, scheme.kind, scheme.group, scheme.symmetric)
    mine = to_packed(qw)
    signed = (unpack_int4(qw.qweight).to(torch.int16) - 8).to(torch.int8) if scheme.bits == 4 else qw.qweight
    assert torch.equal(pack_to_int32(signed, scheme.bits), mine["_packed"])
    zero = None if scheme.symmetric else (qw.zeros.to(torch.int16) - 8).to(torch.int8)
    if zero is not None:
        assert torch.equal(pack_to_int32(zero, scheme.bits, packed_dim=0), mine["_zero_point"])
    args = QuantizationArgs(
        num_bits=scheme.bits, type="int", symmetric=scheme.symmetric, group_size=scheme.group, strategy="group" if scheme.bits == 4 else "channel"
    )
    cs = QuantizationScheme(targets=["Linear"], weights=args)
    # What pocketllm wrote, decompressed by the package (which computes in the scales' dtype).
    stored = {"weight" + k: v for k, v in mine.items()}
    theirs = PackedQuantizationCompressor.decompress(stored, cs)["weight"]
    assert torch.equal(theirs, dequantize(qw).to(theirs.dtype))
    # What the package wrote (its own rounding), read by pocketllm, whole and as TP shards.
    sd = {"weight": w, "weight_scale": qw.scales if scheme.bits == 4 else qw.scales.view(rows, 1)}
    if zero is not None:
        sd["weight_zero_point"] = zero
    packed = PackedQuantizationCompressor.compress(sd, cs)
    want = PackedQuantizationCompressor.decompress(dict(packed), cs)["weight"]
    path = tmp_path / "w.safetensors"
    save_file({"x.weight" + k.removeprefix("weight"): v.contiguous() for k, v in packed.items()}, str(path))
    whole = dequantize(read_packed(_File(path), "x.weight", scheme, [(0, rows)], None))
    assert torch.equal(whole.to(want.dtype), want)
    assert torch.equal(dequantize(read_packed(_File(path), "x.weight", scheme, [(3, 11)], None)), whole[3:11])
    assert torch.equal(dequantize(read_packed(_File(path), "x.weight", scheme, None, (128, 256))), whole[:, 128:])


def test_a_quantized_checkpoint_with_a_tied_head_loads_in_transformers_with_our_logits(tmp_path):
    """A head tied to the embedding stays float and has no weight of its own in the file: the
    ignore list must name it, or a reader quantizes it as any other Linear (transformers then
    fails to load the checkpoint)."""
    import json

    import transformers
    from conftest import main_in_process

    out = tmp_path / "tied-int8"
    assert main_in_process("make-checkpoint", "--preset", "tiny", "--tie-word-embeddings", "--quantize", "int8", "--out", out) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor([[1, 2, 3, 4, 5]])).logits[0]
    logits = tmp_path / "logits.safetensors"
    assert main_in_process("generate", "--ckpt", out, "--dtype", "float32", "--token-ids", "1,2,3,4,5", "--max-new-tokens", 1,
                           "--logits-out", logits) == 0
    # A plain file's mode, as the checkpoint's own files have (not safetensors' private 0600).
    assert logits.stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    with safe_open(str(logits), "pt") as f:
        ours = f.get_tensor(f.keys()[0])
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()

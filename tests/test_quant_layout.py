"""The quantized-weight layout: packing round trips, dequantizing stays within a step of the
original, and a shard of the quantized matrix is exactly the quantization's slice."""

from __future__ import annotations

import pytest
import torch

from pocketllm.ops.quant.layout import dequantize, pack_int4, quant_linear_reference, quantize, unpack_int4


def test_int4_packing_round_trips_and_matches_an_int32_nibble_packing():
    q = torch.randint(0, 16, (3, 16), dtype=torch.uint8)
    packed = pack_int4(q)
    assert torch.equal(unpack_int4(packed), q)
    # Eight nibbles per int32, element i at bits 4i: the same bytes on a little-endian host.
    words = torch.zeros(3, 2, dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8].long() << (4 * i)
    as_int32 = words.to(torch.int64).apply_(lambda v: v - (1 << 32) if v >= 1 << 31 else v).to(torch.int32)
    assert torch.equal(as_int32.view(torch.uint8), packed)


@pytest.mark.parametrize("scheme, group, symmetric", [("int8", None, True), ("int4", 32, True), ("int4", 64, False), ("int4", 128, True)])
def test_dequantized_values_are_within_a_step(scheme, group, symmetric):
    torch.manual_seed(0)
    w = torch.randn(24, 256, dtype=torch.bfloat16)
    qw = quantize(w, scheme, group, symmetric)
    assert qw.shape == (24, 256)
    step = qw.scales.float().repeat_interleave(qw.group, dim=1)
    err = (dequantize(qw) - w.float()).abs() / step
    # Rounding is within half a step; the clamped extremes (the scale is rounded to its dtype
    # after the range is divided) within one.
    assert err.max() <= 1.0 and err.mean() <= 0.3


def test_a_shard_is_the_slice_of_the_whole_quantization():
    torch.manual_seed(1)
    w = torch.randn(16, 256)
    whole = quantize(w, "int4", 64, symmetric=False)
    assert torch.equal(dequantize(whole.cols(64, 192)), dequantize(whole)[:, 64:192])
    assert torch.equal(dequantize(whole.rows(4, 12)), dequantize(whole)[4:12])
    with pytest.raises(ValueError, match="group boundaries"):
        whole.cols(32, 192)


def test_reference_product_is_x_times_the_dequantized_matrix():
    torch.manual_seed(2)
    w, x = torch.randn(8, 64), torch.randn(3, 64)
    qw = quantize(w, "int8")
    out = torch.empty(3, 8)
    quant_linear_reference(x, qw, out)
    torch.testing.assert_close(out, x @ dequantize(qw).t())

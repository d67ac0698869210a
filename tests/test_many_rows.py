"""The many-row (prefill) GEMM kernels against their plain reference; how one is chosen per format:
measured on a probe cut from the widest weight and cached, forced by POCKETLLM_KERNELS=many-row=..., refused in
one line when the value names no kernel; and a bound projection running the chosen one."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import usage_error_in_process
from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops import many_rows
from pocketllm.ops.registry import MANY_ROW, Choice, KernelSet, Monitor, choose, pick
from pocketllm.ops.registry import cache as kernel_cache

# (rows of x, out, in): rows beyond one widened block with a remainder, and widths that end mid-vector.
SHAPES = [(16, 64, 256), (9, many_rows.BLOCK_ROWS + 37, 33), (130, 7, 1000)]
# Judges the machine quiet whatever runs beside the test: these tests are about the cache, not
# about trust (test_registry.py disturbs the machine for real).
TOLERANT = Monitor(others_share=float("inf"), steal_share=float("inf"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(MANY_ROW.by_name))
def test_every_kernel_matches_the_reference(name, shape, dtype):
    torch.manual_seed(0)
    t, o, i = shape
    x, w = torch.randn(t, i, dtype=dtype), torch.randn(o, i, dtype=dtype)
    want = torch.empty(t, o, dtype=dtype)
    many_rows.gemm_reference(x, w, want)
    got = torch.full((t, o), float("nan"), dtype=dtype)
    cand = MANY_ROW.by_name[name]
    if cand.sources and cand.unavailable(str(dtype).removeprefix("torch."), torch.device("cpu")):
        # A compiled kernel refuses what it cannot run: another dtype by name, bf16 where this
        # build lacks it with the build's reason.
        with pytest.raises(ValueError if dtype != torch.bfloat16 else RuntimeError, match="must be bfloat16" if dtype != torch.bfloat16 else "AVX2"):
            cand.run(x, w, got)
        return
    cand.run(x, w, got)
    # Sums in another order: within one rounding of the output dtype, relative to the terms.
    scale = (x.float().abs() @ w.float().abs().t()).max().item()
    tol = 2 * torch.finfo(dtype).eps * max(scale, 1.0)
    assert (got.float() - want.float()).abs().max().item() <= tol


@pytest.mark.skipif(bool(many_rows.c_f32_unavailable("bfloat16", torch.device("cpu"))), reason="no AVX2 with FMA: c-f32 is not built here")
def test_the_compiled_gemm_gives_a_row_the_same_bits_in_any_call():
    # A prompt's rows must not depend on how it was cut into passes: each row alone and the rows
    # of calls of 2..13 at every offset (around the six-row tile, past one 256-input block, 150
    # weight rows ending mid-panel) equal the 19-row call bit for bit.
    torch.manual_seed(1)
    x, w = torch.randn(19, 300, dtype=torch.bfloat16), torch.randn(150, 300, dtype=torch.bfloat16)
    whole = torch.empty(19, 150, dtype=torch.bfloat16)
    many_rows.c_f32(x, w, whole)
    for m in (1, 2, 5, 6, 7, 13):
        for c0 in range(0, 19 - m + 1, 4):
            part = torch.empty(m, 150, dtype=torch.bfloat16)
            many_rows.c_f32(x[c0 : c0 + m].contiguous(), w, part)
            assert torch.equal(part, whole[c0 : c0 + m]), (m, c0)
    with pytest.raises(ValueError, match=r"c-f32: out has shape \(19, 149\)"):
        many_rows.c_f32(x, w, torch.empty(19, 149, dtype=torch.bfloat16))


def test_a_bound_projection_runs_the_many_row_kernel_chosen_for_its_format():
    kernels = KernelSet([Choice(MANY_ROW, "bfloat16", "forced", {"probe": "mm-f32"})])
    x, w = torch.randn(40, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    assert kernels.bind(w).names["many-row"] == "mm-f32"
    torch.testing.assert_close(kernels.bind(w)(x).float(), x.float() @ w.float().t(), atol=0.05, rtol=0.02)
    # Another format's weights keep the kind's default.
    assert kernels.bind(w.float()).names["many-row"] == "mm"


def test_measured_then_cached_then_forced(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    from pocketllm.ops.registry import measure

    monkeypatch.setattr(measure, "PROBE_ROWS", 32)
    weights = [torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)]
    first = choose(MANY_ROW, weights, env={}, monitor=TOLERANT)
    assert first.how == "measured" and set(first.seconds["probe"]) == set(MANY_ROW.timed("bfloat16", torch.device("cpu")))
    assert first.by_key["probe"] == pick(MANY_ROW, first.seconds["probe"])
    # The probe is cut from the widest weight.
    assert first.probe == "32x96 @ 96x64"
    cache = json.loads((tmp_path / kernel_cache.FILE).read_text())
    assert len(cache) == 1 and all("bfloat16" in key and f"{torch.get_num_threads()} threads" in key for key in cache)
    # The check at load (tests/test_registry.py) held to agree: these calls take tens of
    # microseconds, past its threshold only when the machine is loaded, and then it once
    # disagreed and re-measured.
    monkeypatch.setattr(sys.modules["pocketllm.ops.registry.choose"], "CHECK_MIN_CALL_S", float("inf"))
    again = choose(MANY_ROW, weights, env={}, monitor=TOLERANT)
    assert again.how == "cached" and again.by_key == first.by_key and again.seconds == first.seconds
    assert choose(MANY_ROW, weights, env={"POCKETLLM_KERNELS": "many-row=mm-f32"}).by_key["probe"] == "mm-f32"
    assert choose(MANY_ROW, weights, env={"POCKETLLM_KERNELS": "many-row=mm"}).how == "forced"
    # fp32 weights have nothing to widen: no measurement.
    assert choose(MANY_ROW, [w.float() for w in weights], env={}).how == "default"
    assert "many-row GEMM (measured): " in first.describe() and first.to_json()["by_key"] == {"32x96 @ 96x64": first.by_key["probe"]}


def test_a_bad_forced_kernel_is_refused(no_ranks, capsys, monkeypatch):
    with pytest.raises(UsageError, match="POCKETLLM_KERNELS: many-row='fast' is not a many-row kernel"):
        MANY_ROW.forced({"POCKETLLM_KERNELS": "many-row=fast"})
    assert MANY_ROW.forced({"POCKETLLM_KERNELS": "many-row=auto"}) is None
    monkeypatch.setenv("POCKETLLM_KERNELS", "many-row=fastest")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", expect=("POCKETLLM_KERNELS: many-row='fastest'", "auto, mm"))

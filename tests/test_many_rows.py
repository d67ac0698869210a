"""The many-row (prefill) GEMM kernels against their plain reference, and how one is chosen per
dtype: measured on a probe and cached per machine, forced by POCKETLLM_GEMM, refused in one line
when the value names no kernel."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import usage_error_in_process
from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops import many_rows
from pocketllm.ops.gemm import linear_rows

# (rows of x, out, in): rows beyond one widened block with a remainder, and widths that end mid-vector.
SHAPES = [(16, 64, 256), (9, many_rows.BLOCK_ROWS + 37, 33), (130, 7, 1000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(many_rows.CANDIDATES))
def test_every_kernel_matches_the_reference(name, shape, dtype):
    torch.manual_seed(0)
    t, o, i = shape
    x, w = torch.randn(t, i, dtype=dtype), torch.randn(o, i, dtype=dtype)
    want = torch.empty(t, o, dtype=dtype)
    many_rows.gemm_reference(x, w, want)
    got = torch.full((t, o), float("nan"), dtype=dtype)
    many_rows.CANDIDATES[name].run(x, w, got)
    # Sums in another order: within one rounding of the output dtype, relative to the terms.
    scale = (x.float().abs() @ w.float().abs().t()).max().item()
    tol = 2 * torch.finfo(dtype).eps * max(scale, 1.0)
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_many_rows_run_the_kernel_installed_for_the_dtype(monkeypatch):
    calls = []
    fake = many_rows.Candidate("mm-f32", lambda x, w, out: calls.append(tuple(x.shape)) or out.fill_(7), "")
    monkeypatch.setitem(many_rows.CANDIDATES, "mm-f32", fake)
    monkeypatch.setattr(many_rows, "_installed", {})
    many_rows.install(many_rows.GemmChoice("forced", "mm-f32"), torch.bfloat16)
    x, w = torch.randn(40, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    assert (linear_rows(x, w) == 7).all() and calls == [(40, 16)]
    # Another dtype's weights keep torch's GEMM.
    xf, wf = x.float(), w.float()
    assert torch.equal(linear_rows(xf, wf), xf @ wf.t()) and len(calls) == 1


def test_measured_then_cached_then_forced(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(many_rows, "PROBE_ROWS", 32)
    weights = [torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)]
    first = many_rows.choose(weights, env={})
    assert first.how == "measured" and set(first.seconds) == set(many_rows.CANDIDATES)
    assert first.kernel == many_rows.pick(first.seconds)
    # The probe is cut from the widest weight.
    assert first.probe == "32x96 @ 96x64"
    cache = json.loads((tmp_path / many_rows.CACHE_FILE).read_text())
    assert len(cache) == 1 and all("bfloat16" in key and f"{torch.get_num_threads()} threads" in key for key in cache)
    again = many_rows.choose(weights, env={})
    assert again.how == "cached" and again.kernel == first.kernel and again.seconds == first.seconds
    assert many_rows.choose(weights, env={many_rows.ENV_GEMM: "mm-f32"}).kernel == "mm-f32"
    assert many_rows.choose(weights, env={many_rows.ENV_GEMM: "mm"}).how == "forced"
    # fp32 weights have nothing to widen: no measurement.
    assert many_rows.choose([w.float() for w in weights], env={}).how == "default"
    assert "mm-f32" in first.describe() and first.to_json()["kernel"] == first.kernel


def test_widening_is_chosen_only_when_it_wins_by_more_than_the_wash():
    assert many_rows.pick({"mm": 1.0, "mm-f32": 0.5}) == "mm-f32"
    assert many_rows.pick({"mm": 1.0, "mm-f32": 0.97}) == "mm"
    assert many_rows.pick({"mm": 1.0, "mm-f32": 2.0}) == "mm"


def test_a_bad_forced_kernel_is_refused(no_ranks, capsys, monkeypatch):
    with pytest.raises(UsageError, match="POCKETLLM_GEMM='fast' is not a many-row kernel"):
        many_rows.forced_kernel({many_rows.ENV_GEMM: "fast"})
    assert many_rows.forced_kernel({many_rows.ENV_GEMM: "auto"}) is None
    monkeypatch.setenv(many_rows.ENV_GEMM, "fastest")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", expect=("POCKETLLM_GEMM='fastest'", "auto, mm"))

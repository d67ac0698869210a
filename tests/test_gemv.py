"""The one-row kernels against their plain reference, and how one is chosen per weight shape:
measured and cached per machine, forced by POCKETLLM_GEMV, refused in one line when it cannot run."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import usage_error_in_process
from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops import gemv
from pocketllm.ops.gemv import choice as gemv_choice
from pocketllm.ops.gemv.kernels import CANDIDATES, FEW_ROW_CANDIDATES, gemv_reference, kernels_for, rows_reference

# (out, in): a multiple of every vector width, then rows that leave a remainder after the
# four-row blocks and widths that end mid-vector.
SHAPES = [(64, 256), (7, 1000), (130, 33), (1, 5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_kernel_matches_the_reference(shape, dtype):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    x = torch.randn(shape[1], dtype=dtype)
    want = torch.empty(shape[0], dtype=dtype)
    gemv_reference(x, w, want)
    names = [c.name for c in kernels_for(dtype, torch.device("cpu"))]
    if dtype == torch.bfloat16:
        # The compiled kernel must be among them here: the machines this suite runs on have a compiler.
        assert "c" in names
    for name in names:
        got = torch.full((shape[0],), float("nan"), dtype=dtype)
        CANDIDATES[name].run(x, w, got)
        # Sums in another order: within one rounding of the output dtype, relative to the terms.
        scale = (w.float().abs() @ x.float().abs()).max().item()
        tol = 2 * torch.finfo(dtype).eps * max(scale, 1.0)
        assert (got.float() - want.float()).abs().max().item() <= tol, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("shape", SHAPES + [(33, 64), (16, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_few_row_kernel_matches_the_reference(shape, rows, dtype):
    # Row counts around the AVX-512 tile's four and past AMX's sixteen columns, weight rows
    # around both tiles' blocks, widths that are and are not a multiple of an AMX tile's 32.
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    x = torch.randn(rows, shape[1], dtype=dtype)
    want = torch.empty(rows, shape[0], dtype=dtype)
    rows_reference(x, w, want)
    names = [c.name for c in kernels_for(dtype, torch.device("cpu"), rows)]
    assert ("c" in names) == (dtype == torch.bfloat16)
    scale = max((x.float().abs() @ w.float().abs().t()).max().item(), 1.0)
    for name in names:
        got = torch.full((rows, shape[0]), float("nan"), dtype=dtype)
        FEW_ROW_CANDIDATES[name].run(x, w, got)
        assert (got.float() - want.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * scale, name


def test_few_rows_run_the_kernel_chosen_for_the_next_row_count_up(monkeypatch, tmp_path):
    from pocketllm.ops.gemm import linear_rows

    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    w = torch.randn(12, 32, dtype=torch.bfloat16)
    choice = gemv.choose([w], env={}, rows=4)
    assert choice.how == "measured" and choice.rows == 4 and "4-row kernels" in choice.describe()
    assert set(choice.seconds[(12, 32)]) == {c.name for c in kernels_for(torch.bfloat16, torch.device("cpu"), 4)} >= {"mm", "c"}
    assert gemv.choose([w], env={}, rows=4).how == "cached"
    calls = []
    monkeypatch.setitem(FEW_ROW_CANDIDATES, "c", FEW_ROW_CANDIDATES["c"].__class__("c", lambda x, w, out: calls.append(x.shape[0]) or out.zero_(), ""))
    gemv.install(gemv.GemvChoice("forced", {(12, 32): "c"}, rows=4), torch.bfloat16)
    for m in (2, 3, 4, 5):
        linear_rows(torch.randn(m, 32, dtype=torch.bfloat16), w)
    # 5 rows is past every row count chosen for: torch's GEMM ran it.
    assert calls == [2, 3, 4]
    gemv.install(gemv.GemvChoice("forced", {(12, 32): "mm"}, rows=4), torch.bfloat16)
    with pytest.raises(UsageError, match="POCKETLLM_FEW_ROWS='mv' is not a few-row kernel"):
        gemv.forced_kernel({gemv.ENV_FEW_ROWS: "mv"}, rows=2)


def test_a_shape_runs_the_kernel_chosen_for_it(monkeypatch):
    calls = []
    w, other = torch.randn(12, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    try:
        monkeypatch.setitem(CANDIDATES, "mm", CANDIDATES["mm"].__class__("mm", lambda x, w, out: calls.append(tuple(w.shape)) or out.zero_(), ""))
        gemv.install(gemv.GemvChoice("forced", {(12, 32): "mm"}), torch.bfloat16)
        out = torch.empty(12, dtype=torch.bfloat16)
        gemv.gemv_row(torch.randn(32, dtype=torch.bfloat16), w, out)
        gemv.gemv_row(torch.randn(32, dtype=torch.bfloat16), other, torch.empty(16, dtype=torch.bfloat16))
        assert calls == [(12, 32)]
    finally:
        gemv.install(gemv.GemvChoice("default", {(12, 32): "mv"}), torch.bfloat16)


def test_measured_then_cached_then_forced(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    weights = [torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)]
    first = gemv.choose(weights, env={})
    assert first.how == "measured" and set(first.by_shape) == {(48, 64), (64, 48)}
    # Every candidate that can run bf16 here was timed on every shape, and the fastest won.
    for shape, seconds in first.seconds.items():
        assert set(seconds) == {c.name for c in kernels_for(torch.bfloat16, torch.device("cpu"))}
        assert first.by_shape[shape] == gemv_choice.pick(seconds)
    cache = json.loads((tmp_path / "gemv.json").read_text())
    assert len(cache) == 2 and all(f"{torch.get_num_threads()} threads" in key for key in cache)
    again = gemv.choose(weights, env={})
    assert again.how == "cached" and again.by_shape == first.by_shape
    # Another thread count is another machine setting: measured anew.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert gemv.choose(weights, env={}).how == "measured"
    finally:
        torch.set_num_threads(threads)
    forced = gemv.choose(weights, env={gemv.ENV_GEMV: "mv-native"})
    assert forced.how == "forced" and set(forced.by_shape.values()) == {"mv-native"}


def test_a_wash_goes_to_the_compiled_kernel_and_a_real_gap_to_the_fastest():
    assert gemv_choice.pick({"mv": 1.0, "c": 1.01, "mm": 2.0}) == "c"
    assert gemv_choice.pick({"mv": 1.0, "c": 1.05, "mm": 2.0}) == "mv"
    assert gemv_choice.pick({"mv": 1.0, "mm": 1.001}) == "mv"
    assert gemv_choice.pick({"mm": 1.0, "c": 1.01, "amx": 1.015}, rows=4) == "amx"
    assert gemv_choice.pick({"mm": 1.0, "c": 1.01, "amx": 1.5}, rows=4) == "c"


def test_a_bad_or_impossible_forced_kernel_is_refused():
    with pytest.raises(UsageError, match="POCKETLLM_GEMV='fast' is not a one-row kernel"):
        gemv.forced_kernel({gemv.ENV_GEMV: "fast"})
    with pytest.raises(UsageError, match="POCKETLLM_GEMV=c: the compiled kernel takes bfloat16"):
        gemv.check_forced(torch.float32, "cpu", {gemv.ENV_GEMV: "c"})
    gemv.check_forced(torch.bfloat16, "cpu", {gemv.ENV_GEMV: "c"})


def test_the_cli_refuses_a_bad_kernel_before_any_rank(no_ranks, capsys, monkeypatch):
    monkeypatch.setenv(gemv.ENV_GEMV, "fastest")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", expect=("POCKETLLM_GEMV='fastest'", "auto, mv"))


def test_without_a_compiler_the_compiled_kernel_is_left_out(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(compiled, "_loaded", {})
    from pocketllm.ops.gemv import kernels

    monkeypatch.setattr(kernels, "_c_gemv", None)
    assert "c" not in [c.name for c in kernels_for(torch.bfloat16, torch.device("cpu"))]
    assert "no C compiler" in CANDIDATES["c"].unavailable(torch.bfloat16, torch.device("cpu"))
    with pytest.raises(UsageError, match="POCKETLLM_GEMV=c: no C compiler"):
        gemv.check_forced(torch.bfloat16, "cpu", {gemv.ENV_GEMV: "c"})
    from pocketllm.ops.fused import decode_ops

    ops = decode_ops(torch.bfloat16, torch.device("cpu"))
    assert not ops.compiled and "no C compiler" in ops.describe()
    assert gemv_choice.choose([torch.randn(8, 8, dtype=torch.bfloat16)], env={}).how in ("measured", "cached")

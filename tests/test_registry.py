"""The kernel registry: row classes, the wash rule, forcing and its errors, the cache of measured
choices, and the trust checks around it, under real disturbance: busy loops on the cores during a
measurement leave nothing in the cache, a spoiled or refuted cache entry is measured again, two
processes writing the cache at once keep both their entries, and each engine binds its own
kernels."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from conftest import feed, usage_error_in_process
from pocketllm import compiled, switches
from pocketllm.bench.busy import BusyLoops
from pocketllm.errors import UsageError
from pocketllm.ops.gemv import kernels as gemv
from pocketllm.ops.registry import (
    FEW,
    FEW_ROW,
    MANY,
    MANY_ROW,
    NOT_CACHED_BUSY,
    ONE,
    ONE_ROW,
    KernelSet,
    Monitor,
    all_kinds,
    check_forced,
    choose,
    few_rows_for,
    pick,
    row_class,
)
from pocketllm.ops.registry import cache as kernel_cache
from pocketllm.ops.registry.choose import CHECK_MIN_CALL_S, cache_key

# Judges the machine quiet whatever else runs: for the tests of what the cache does once a
# measurement counts as trusted (the busy-loop test below uses the real thresholds).
TOLERANT = Monitor(others_share=float("inf"), steal_share=float("inf"))


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    return tmp_path


def bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def write_entries(kind, weights, seconds: dict) -> None:
    """A cache file holding `seconds` {shape: {kernel: s}} for these weights, as choose writes it."""
    entries = {}
    for shape, by in seconds.items():
        nbytes = shape[0] * shape[1] * 2
        entries[cache_key(kind, "bfloat16", shape, 1)] = {"kernel": pick(kind, by), "seconds": by, "bytes": nbytes}
    kernel_cache.write(entries)


def test_row_classes_decide_every_kernel_and_the_one_row_forms():
    assert [row_class(r) for r in (1, 2, 16, 17, 4096)] == [ONE, FEW, FEW, MANY, MANY]
    assert few_rows_for(1) == [] and few_rows_for(4) == [2, 4] and few_rows_for(5) == [2, 4, 8] and few_rows_for(99) == [2, 4, 8, 16]


def test_a_wash_goes_to_the_preferred_kernel_and_a_real_gap_to_the_fastest():
    assert pick(ONE_ROW, {"mv": 1.0, "c": 1.02, "mm": 2.0}) == "c"
    assert pick(ONE_ROW, {"mv": 1.0, "c": 1.05, "mm": 2.0}) == "mv"
    assert pick(ONE_ROW, {"mv": 1.0, "mm": 1.001}) == "mv"
    assert pick(FEW_ROW, {"mm": 1.0, "c": 1.01, "amx": 1.025}) == "amx"
    assert pick(FEW_ROW, {"mm": 1.0, "c": 1.01, "amx": 1.5}) == "c"


def test_forced_kernels_and_their_one_line_errors():
    with pytest.raises(UsageError, match="^POCKETLLM_KERNELS: one-row='fast' is not a one-row kernel: use auto, mv, mv-native, mm, c, c-prefetch"):
        ONE_ROW.forced({"POCKETLLM_KERNELS": "one-row=fast"})
    with pytest.raises(UsageError, match="^POCKETLLM_KERNELS: few-row='mv' is not a few-row kernel"):
        FEW_ROW.forced({"POCKETLLM_KERNELS": "few-row=mv"})
    with pytest.raises(UsageError, match="^POCKETLLM_KERNELS=one-row=c: the compiled kernel takes bfloat16"):
        check_forced(["float32"], "cpu", {"POCKETLLM_KERNELS": "one-row=c"})
    check_forced(["bfloat16"], "cpu", {"POCKETLLM_KERNELS": "one-row=c"})
    env = {"POCKETLLM_KERNELS": "many-row=mm, one-row=mv-native,few-row=auto"}
    forced = choose(ONE_ROW, [bf16(8, 16), bf16(16, 8)], env=env)
    assert forced.how == "forced" and set(forced.by_key.values()) == {"mv-native"}
    assert FEW_ROW.forced(env) is None and MANY_ROW.forced(env) == "mm"


@pytest.mark.parametrize(
    "value, error",
    [
        ("gemv=c", "'gemv' is not a kernel kind: use one-row, few-row, many-row, panels-one-row, panels-few-row, panels-many-row, int8-one-row, int8-few-row, int8-many-row, int4-one-row,"),
        ("c", "'c' is not kind=kernel: write, e.g., POCKETLLM_KERNELS=one-row=c-ahead,int8-one-row=c$"),
        ("one-row=", "'one-row=' is not kind=kernel"),
        ("one-row=c,one-row=mv", "names one-row twice: c and mv$"),
        ("one-row=c,int8-many-row=c-ahead", "int8-many-row='c-ahead' is not an int8 many-row kernel: use auto, torch, "),
    ],
    ids=["bad-kind", "no-kind", "no-kernel", "kind-twice", "bad-kernel-of-another-kind"],
)
def test_a_bad_kernels_setting_is_one_line_naming_what_is_valid(value, error):
    # The whole variable is checked whichever kind asks.
    for kind in (ONE_ROW, MANY_ROW):
        with pytest.raises(UsageError, match="^POCKETLLM_KERNELS:? " + error) as raised:
            kind.forced({"POCKETLLM_KERNELS": value})
        assert "\n" not in str(raised.value)


def test_the_old_variables_are_refused_with_their_new_spelling(capsys, monkeypatch):
    assert all(name not in switches.SETTINGS for name in switches.RENAMED)
    # Every kind that had a variable of its own (the panel kinds came after them).
    assert set(switches.RENAMED.values()) == {kind.setting for kind in all_kinds() if kind.family != "panels"}
    with pytest.raises(UsageError, match="^POCKETLLM_GEMV=c is now POCKETLLM_KERNELS=one-row=c$"):
        check_forced(["bfloat16"], "cpu", {"POCKETLLM_GEMV": "c"})
    with pytest.raises(UsageError, match="^POCKETLLM_GEMV=c and POCKETLLM_INT4_GEMM=mm are now POCKETLLM_KERNELS=one-row=c,int4-many-row=mm$"):
        choose(ONE_ROW, [bf16(8, 16)], env={"POCKETLLM_INT4_GEMM": "mm", "POCKETLLM_GEMV": "c"})
    # Refused where kernels are forced, so not warned about as an unknown name as well.
    assert switches.environment_notes({"POCKETLLM_FEW_ROWS": "c"}) == []


def test_the_cli_refuses_a_bad_kernel_before_any_rank(no_ranks, capsys, monkeypatch):
    monkeypatch.setenv("POCKETLLM_KERNELS", "one-row=fastest")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", expect=("POCKETLLM_KERNELS: one-row='fastest'", "auto, mv"))
    monkeypatch.setenv("POCKETLLM_KERNELS", "gemv=c")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", expect=("POCKETLLM_KERNELS: 'gemv' is not a kernel kind", "one-row, few-row"))
    monkeypatch.delenv("POCKETLLM_KERNELS")
    monkeypatch.setenv("POCKETLLM_GEMV", "c")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", expect=("POCKETLLM_GEMV=c is now POCKETLLM_KERNELS=one-row=c",))


def test_measured_then_cached_then_measured_for_another_thread_count(cache_dir):
    weights = [bf16(48, 64), bf16(64, 48), bf16(48, 64)]
    first = choose(ONE_ROW, weights, env={}, monitor=TOLERANT)
    assert first.how == "measured" and set(first.by_key) == {(48, 64), (64, 48)}
    # Every available candidate timed; the choice among those a batch-invariant run allows.
    allowed = ONE_ROW.allowed("bfloat16", torch.device("cpu"), True)
    # The AVX2 build's one-row GEMV also has its four-rows-at-a-time form (the same sums).
    grouped = {"c-group", "c-group-ahead"} if gemv.group_rows() > 1 else set()
    assert set(allowed) == {"c", "c-prefetch", "c-ahead"} | grouped
    for shape, seconds in first.seconds.items():
        assert set(seconds) == set(ONE_ROW.timed("bfloat16", torch.device("cpu")))
        assert first.by_key[shape] == pick(ONE_ROW, {n: seconds[n] for n in allowed})
    cache = json.loads((cache_dir / kernel_cache.FILE).read_text())
    assert len(cache) == 2 and all(f"{torch.get_num_threads()} threads" in key for key in cache)
    again = choose(ONE_ROW, weights, env={}, monitor=TOLERANT)
    assert again.how == "cached" and again.by_key == first.by_key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert choose(ONE_ROW, weights, env={}, monitor=TOLERANT).how == "measured"
    finally:
        torch.set_num_threads(threads)


def test_a_busy_machine_measures_but_caches_nothing_and_skips_the_check(cache_dir):
    # One thread: torch's threads waiting for each other at every call while the busy loops hold
    # the cores would only make the test slow.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fresh = [bf16(1024, 1024) for _ in range(2)]
        # Enough bytes that the check at load, capped at CHECK_MAX_PASSES passes, lasts the ~0.1 s
        # the CPU counters need to see the busy loops (16 MiB of them was often too short a window).
        cached_weights = [bf16(4096, 1024) for _ in range(8)]
        seconds = choose(ONE_ROW, cached_weights, env={}, monitor=TOLERANT).seconds
        write_entries(ONE_ROW, cached_weights, seconds)
        with BusyLoops(settle=0.3):
            busy = choose(ONE_ROW, fresh, env={}, monitor=Monitor())
            checked = choose(ONE_ROW, cached_weights, env={}, monitor=Monitor())
    finally:
        torch.set_num_threads(threads)
    assert busy.how == NOT_CACHED_BUSY and "other processes took" in busy.note
    assert "one-row kernels (measured, machine busy: not cached; other processes took" in busy.describe()
    # Used for this run all the same: a kernel per shape, from real timings.
    assert set(busy.by_key) == {(1024, 1024)} and all(s > 0 for s in busy.seconds[(1024, 1024)].values())
    stored = json.loads((cache_dir / kernel_cache.FILE).read_text())
    assert not [k for k in stored if k.endswith("1024x1024")]
    # A cached choice is kept when the machine is too busy to check it.
    assert checked.how == "cached, check skipped: machine busy" and checked.seconds == {k: v for k, v in seconds.items()}


def test_a_spoiled_cache_entry_is_measured_again(cache_dir):
    # As a busy machine left them: one shape's every candidate timed at a fiftieth of its speed.
    weights = [bf16(2048, 1024), bf16(1024, 2048)]
    quiet = choose(ONE_ROW, weights, env={}, monitor=TOLERANT).seconds
    spoiled = {n: 50 * s for n, s in quiet[(1024, 2048)].items()}
    write_entries(ONE_ROW, weights, {(2048, 1024): quiet[(2048, 1024)], (1024, 2048): spoiled})
    again = choose(ONE_ROW, weights, env={}, monitor=TOLERANT)
    assert again.how != "cached" and "cached 1024x2048 implausible" in again.how + again.note
    assert again.seconds[(1024, 2048)] != spoiled
    if again.trusted:
        assert kernel_cache.read()[cache_key(ONE_ROW, "bfloat16", (1024, 2048), 1)]["seconds"] == again.seconds[(1024, 2048)]


def test_a_cached_choice_the_check_refutes_is_measured_again(cache_dir):
    # The cache claims the slowest kernel is four times faster than the fastest: plausible (fast),
    # but the check at load times it against its runner-up and finds otherwise.
    # Weights whose calls are long enough to be judged: 128 MiB of 16 MiB weights, read from
    # memory (32 MiB of them stayed in a 32 MiB last-level cache, and calls under CHECK_MIN_CALL_S
    # are not judged). Every candidate may be chosen (not only those a batch-invariant run allows).
    weights, env = [bf16(8192, 1024) for _ in range(8)], {"POCKETLLM_BATCH_INVARIANT": "0"}
    quiet = choose(ONE_ROW, weights, env=env, monitor=TOLERANT).seconds[(8192, 1024)]
    assert min(quiet.values()) > CHECK_MIN_CALL_S, "calls too short for the check to judge"
    slowest = max(quiet, key=quiet.get)
    claimed = {**quiet, slowest: min(quiet.values()) / 4}
    write_entries(ONE_ROW, weights, {(8192, 1024): claimed})
    again = choose(ONE_ROW, weights, env=env, monitor=TOLERANT)
    assert "re-measured: cached 8192x1024 disagreed" in again.how + again.note
    assert again.seconds[(8192, 1024)][slowest] > claimed[slowest]


def test_an_unreadable_cache_is_measured_again(cache_dir):
    (cache_dir / kernel_cache.FILE).write_text("not json{")
    weights = [bf16(16, 32)]
    assert choose(ONE_ROW, weights, env={}, monitor=TOLERANT).how == "measured"
    key = cache_key(ONE_ROW, "bfloat16", (16, 32), 1)
    kernel_cache.write({key: {"kernel": "mv", "seconds": {n: -1.0 for n in ONE_ROW.by_name}}})
    again = choose(ONE_ROW, weights, env={}, monitor=TOLERANT)
    assert again.how == "re-measured: cached entry unreadable"
    assert all(s > 0 for s in kernel_cache.read()[key]["seconds"].values())
    # An entry from before a candidate could run here is whole, not broken: the line names what
    # it lacks.
    entry = kernel_cache.read()[key]
    kernel_cache.write({key: {**entry, "seconds": {n: t for n, t in entry["seconds"].items() if n != "c-ahead"}}})
    assert choose(ONE_ROW, weights, env={}, monitor=TOLERANT).how == "re-measured: cached entry lacks c-ahead"
    # Sound entries beside a shape no earlier run had are not unreadable: the line says what is new.
    more = choose(ONE_ROW, [*weights, bf16(24, 32)], env={}, monitor=TOLERANT)
    assert more.how == "re-measured: 1 of 2 shapes not cached (24x32)", more.how


def _write_many(tag: str, n: int) -> None:
    for i in range(n):
        kernel_cache.write({f"{tag}-{i}": {"kernel": "mv", "seconds": {"mv": 1.0 + i}}})


def test_two_processes_writing_the_cache_at_once_keep_both_their_entries(cache_dir):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(tag, 60)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    data = json.loads((cache_dir / kernel_cache.FILE).read_text())
    assert sorted(data) == sorted(f"{t}-{i}" for t in "ab" for i in range(60))
    assert not [p for p in cache_dir.iterdir() if p.name.endswith(".tmp")]


def test_each_engine_binds_its_own_kernels(monkeypatch, cache_dir):
    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    set_tp(0, 1)
    cfg = get_preset("tiny").with_layers(2)
    engines = {}
    for name in ("mv", "c"):
        monkeypatch.setenv("POCKETLLM_KERNELS", f"one-row={name}")
        engines[name] = Engine(cfg, RandomWeights(cfg), torch.bfloat16, torch.device("cpu"), RulePolicy())
    logits = {}
    for name, eng in engines.items():
        # Where each projection runs, its kernel is in the layer: no table elsewhere that the
        # second engine's constructor could have overwritten.
        assert {m.kernels.names["one-row"] for m in eng.model.projections()} == {name}
        assert eng.kernels.describe()[0].startswith("one-row kernels (forced)")
        eng.reserve_slots(1, 8)
        feed(eng, [3, 1, 4, 1, 5])
        logits[name] = feed(eng, [9], start=5)
    assert (logits["mv"] - logits["c"]).abs().max().item() <= 0.05 * logits["mv"].abs().max().item()


def test_a_new_kind_is_only_its_candidates(monkeypatch, cache_dir):
    # An int8 family declared in place of the real one: a one-row and a many-row kind, one
    # candidate running the reference on the weight as loaded, one running a prepared (widened)
    # layout that both kinds' candidates share.
    from pocketllm.ops.quant.layout import dequantize, quant_linear_reference, quantize
    from pocketllm.ops.registry import Candidate, Kind, kind_for
    from pocketllm.ops.registry import kinds as registry_kinds

    prepared = []

    def widen(qw):
        prepared.append(qw)
        return dequantize(qw).to(torch.bfloat16)

    def on_widened(x, w, out):
        out.copy_(x.float() @ w.float().t())

    def declare(name, rows):
        return Kind(
            name, "int8", rows,
            (Candidate("ref", quant_linear_reference, "the reference"),
             Candidate("widened", on_widened, "a bf16 copy", prepare=widen, layout="widened")),
            default="ref", probe="stream" if rows == ONE else "widest",
        )

    # A registry of its own for the test: deleting a kind from the real one and putting it back
    # moves it to the end, and the kinds are listed (in messages) in the order they were declared.
    kinds = {key: kind for key, kind in registry_kinds._KINDS.items() if key != ("int8", FEW)}
    kinds |= {("int8", ONE): declare("one-row", ONE), ("int8", MANY): declare("many-row", MANY)}
    monkeypatch.setattr(registry_kinds, "_KINDS", kinds)
    assert kind_for("int8", ONE).name == "one-row" and kind_for("int8", FEW) is None
    weights = [quantize(torch.randn(48, 64), "int8", scale_dtype=torch.bfloat16) for _ in range(2)]
    chosen = KernelSet.choose(weights, env={"POCKETLLM_KERNELS": "int8-one-row=widened"})
    assert chosen.describe()[0].startswith("int8 one-row kernels (forced): 48x64 widened")
    prepared.clear()
    bound = chosen.bind(weights[0])
    # One prepared copy, shared by every row class that runs the widened layout.
    assert bound.names["one-row"] == "widened" and len(prepared) == 1
    for rows in (1, 3, 40):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        want = torch.empty(rows, 48, dtype=torch.bfloat16)
        quant_linear_reference(x, weights[0], want)
        torch.testing.assert_close(bound(x).float(), want.float(), atol=0.05, rtol=0.02)
    with pytest.raises(UsageError, match="int8-one-row='c' is not an int8 one-row kernel: use auto, ref, widened"):
        KernelSet.choose(weights, env={"POCKETLLM_KERNELS": "int8-one-row=c"})

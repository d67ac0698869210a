"""The calibrated slice policy: its choices on hand-written points (ties, a wash within 2%, rows
between and beyond the calibrated ones, the ceiling), the calibration file's validation, the
refusal of a calibration made for another run, and a real calibration at TP=2."""

from __future__ import annotations

import json

import pytest

from conftest import main_in_process, run_cli, usage_error_in_process
from pocketllm.commands import ranked
from pocketllm.distributed.calibration import Calibration, Point, check_calibration, load_calibration, parse_calibration
from pocketllm.distributed.policy import CalibratedPolicy, RulePolicy, choose_slices, resolve_policy
from pocketllm.errors import UsageError

# seconds per unit at (rows, slices): a made-up machine whose crossover is at 2048 rows.
TIMES = {
    512: {1: 1.00, 2: 1.30, 4: 2.00, 8: 3.00},
    1024: {1: 1.00, 2: 0.985, 4: 1.20, 8: 1.60},  # 2 is 1.5% faster: a wash, keep 1
    2048: {1: 1.00, 2: 0.90, 4: 0.95, 8: 1.10},  # 2 clearly fastest
    4096: {1: 1.00, 2: 0.90, 4: 0.80, 8: 0.80},  # 4 and 8 tie: fewer wins
    8192: {1: 1.00, 2: 0.90, 4: 0.85, 8: 0.70},  # 8 fastest, but above the default ceiling
}


def _points(times=TIMES) -> list[Point]:
    return [Point(r, s, t) for r, by in times.items() for s, t in by.items()]


def _cal(**over) -> Calibration:
    fields = dict(backend="gloo", device="CPU (2 cores)", world=2, hidden=64, dtype="bfloat16", created="2026-01-01T00:00:00+00:00", points=_points())
    fields.update(over)
    return Calibration(**fields)


def test_choices_at_calibrated_rows():
    assert choose_slices(_points(), ceiling=8) == {512: 1, 1024: 1, 2048: 2, 4096: 4, 8192: 8}


def test_a_wash_keeps_fewer_slices_and_a_clear_win_does_not():
    assert choose_slices([Point(1024, 1, 1.0), Point(1024, 2, 0.981)], 4) == {1024: 1}
    assert choose_slices([Point(1024, 1, 1.0), Point(1024, 2, 0.979)], 4) == {1024: 2}
    assert choose_slices([Point(1024, 1, 1.0), Point(1024, 2, 1.0)], 4) == {1024: 1}


def test_rows_between_beyond_and_below():
    policy = CalibratedPolicy(_cal(), ceiling=8)
    assert [policy.slices_for_rows(r) for r in (1, 100, 511)] == [1, 1, 1]
    assert policy.slices_for_rows(512) == 1
    # Between calibrated counts: the nearest calibrated count below.
    assert policy.slices_for_rows(2047) == 1
    assert policy.slices_for_rows(3000) == 2
    assert policy.slices_for_rows(4097) == 4
    # Above the largest: the largest's choice.
    assert policy.slices_for_rows(100_000) == 8


def test_never_above_the_ceiling():
    # At the default ceiling 4, 8192 rows picks the best of 1, 2, 4 rather than clamping 8 to 4.
    policy = CalibratedPolicy(_cal())
    assert policy.ceiling == 4 and policy.slices_for_rows(8192) == 4
    assert CalibratedPolicy(_cal(), ceiling=2).choices == {512: 1, 1024: 1, 2048: 2, 4096: 2, 8192: 2}
    for off in (0, 1):
        assert all(CalibratedPolicy(_cal(), ceiling=off).slices_for_rows(r) == 1 for r in (512, 8192, 100_000))
    # Only counts above the ceiling were measured at a row count: serial there.
    assert choose_slices([Point(4096, 8, 0.5)], 4) == {4096: 1}


def test_resolution_flags_and_env(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_cal().to_json()))
    assert isinstance(resolve_policy(env={}).policy, RulePolicy)
    assert isinstance(resolve_policy(calibration=str(path), env={}).policy, CalibratedPolicy)
    assert isinstance(resolve_policy(env={"POCKETLLM_CALIBRATION": str(path)}).policy, CalibratedPolicy)
    assert isinstance(resolve_policy(overlap_policy="rule", calibration=str(path), env={}).policy, RulePolicy)
    assert resolve_policy(ceiling="8", calibration=str(path), env={}).policy.slices_for_rows(8192) == 8
    with pytest.raises(UsageError, match="needs --calibration"):
        resolve_policy(overlap_policy="calibrated", env={})


def test_mismatch_is_named_and_force_uses_it():
    cal = _cal()
    assert check_calibration(cal, "c.json", "gloo", 2, 64, "bfloat16", force=False) is None
    with pytest.raises(UsageError, match=r"TP world size 2 \(this run 4\), hidden size 64 \(this run 1024\)"):
        check_calibration(cal, "c.json", "gloo", 4, 1024, "bfloat16", force=False)
    with pytest.raises(UsageError, match=r"backend gloo \(this run nccl\)"):
        check_calibration(cal, "c.json", "nccl", 2, 64, "bfloat16", force=False)
    note = check_calibration(cal, "c.json", "gloo", 2, 64, "float32", force=True)
    assert "dtype bfloat16 (this run float32)" in note


GOOD = _cal().to_json()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("world"), "missing 'world'"),
        (lambda d: d.update(points=[]), "no points"),
        (lambda d: d.pop("points"), "no points"),
        (lambda d: d.update(world="2"), "'world' is '2'"),
        (lambda d: d.update(world=True), "'world' is True"),
        (lambda d: d["points"][0].update(seconds=-1.0), "must be positive"),
        (lambda d: d["points"][0].update(seconds="fast"), "points[0].'seconds'"),
        (lambda d: d["points"][0].pop("slices"), "missing points[0].'slices'"),
        (lambda d: d["points"].append(dict(d["points"][0])), "repeats rows 512 slices 1"),
        (lambda d: d.update(allreduce_fit=[1, 2]), "allreduce_fit is not an object"),
    ],
)
def test_file_validation(mutate, message):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    with pytest.raises(UsageError) as err:
        parse_calibration(data, "c.json")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(GOOD))
    cal = load_calibration(str(path))
    assert cal.points == _points() and cal.world == 2


@pytest.mark.parametrize("content, message", [("not json", "not valid JSON"), ("[1, 2]", "not a JSON object"), (None, "cannot read")])
def test_bad_files_exit_2(tmp_path, content, message, capsys, no_ranks):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    usage_error_in_process(capsys, "policy", "--calibration", path, expect=message)


def test_policy_command_inspects_a_foreign_calibration(tmp_path, capsys, monkeypatch):
    """No ranks, no mismatch check: an NCCL, TP=8, 27B-shaped calibration prints its choices here."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_cal(backend="nccl", world=8, hidden=5120, device="8 x H100").to_json()))
    assert main_in_process("policy", "--calibration", path, "--rows", "256,1024,3000,8192", "--comm-overlap-slices", "8") == 0
    out = capsys.readouterr()
    assert out.out.split() == ["rows=256", "slices=1", "rows=1024", "slices=1", "rows=3000", "slices=2", "rows=8192", "slices=8"]
    assert "nccl, TP=8, hidden 5120" in out.err
    monkeypatch.setenv("POCKETLLM_CALIBRATION", str(path))
    assert main_in_process("policy", "--rows", "3000") == 0
    assert capsys.readouterr().out.strip() == "rows=3000 slices=2"


def test_a_run_refuses_a_calibration_for_another_run(tmp_path, capsys, no_ranks):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(GOOD))
    # Refused in the launcher, before any rank starts (no_ranks fails the test if one is).
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", "--dtype", "float32", "--calibration", path, expect="dtype bfloat16 (this run float32)")


def test_a_calibration_measured_on_another_all_reduce_is_refused_once_the_ranks_know_theirs(tmp_path):
    """shm or gloo is known only once the ranks have set it up (auto takes either): the ranks
    refuse a calibration measured on the other, in one line, or note it under --force-calibration."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**GOOD, "collective": "shm"}))
    args = ("bench", "--preset", "tiny", "--tp-world", "2", "--collective", "gloo", "--calibration", path, "--prompt-tokens", "8", "--max-new-tokens", "1")
    r = run_cli(*args, timeout=120)
    # After the lines a run prints as its ranks start (the all-reduce chosen, the pinning).
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("pocketllm: error: calibration") and "was made for the shm all-reduce (this run gloo)" in last, r.stderr
    r = run_cli(*args, "--force-calibration", timeout=120)
    assert r.returncode == 0 and "note: using calibration" in r.stderr and "made for the shm all-reduce (this run gloo)" in r.stderr, r.stderr


def test_calibrate_at_tp2_writes_a_usable_file(tmp_path, monkeypatch):
    out = tmp_path / "cal.json"
    # No --tp-world: like allreduce, calibrate starts two ranks (the model flags' default of one
    # rank has nothing to calibrate).
    # 8 rows, not 2: a timing repeats a short unit up to 2048 rows, so the smallest row count
    # sets the test's time (its all-reduces); 8 still takes the few-row kernels.
    # --pin without 1: serial is timed anyway, every choice being made against it; 16 slices of 8
    # rows would run serially, so that is no point.
    r = run_cli("calibrate", "--preset", "tiny", "--rows", "8,256", "--pin", "2,16", "--reps", "2", "--out", out, timeout=120)
    assert r.returncode == 0, r.stderr
    # The points time the kernels the engine would run, chosen as the engine chooses them.
    assert all(f"{what} (" in r.stderr for what in ("one-row kernels", "2-row kernels", "8-row kernels", "many-row GEMM")), r.stderr
    cal = load_calibration(str(out))
    assert (cal.backend, cal.world, cal.hidden, cal.dtype) == ("gloo", 2, 64, "bfloat16")
    assert sorted((p.rows, p.slices) for p in cal.points) == [(8, 1), (8, 2), (256, 1), (256, 2), (256, 16)]
    assert all(len(p.reps) == 2 for p in cal.points)
    assert set(cal.allreduce_fit) >= {"fixed_us", "bandwidth_GBps", "max_rel_err"}
    raw = json.loads(out.read_text())
    assert raw["unit"].startswith("4 x mlp.down")
    # The same run's bench accepts it: the launcher, which checks the file against the run before
    # it starts a rank, goes on to start two.
    started = []
    monkeypatch.setattr(ranked, "spawn_local_ranks", lambda run, forward_signals=0.0, checked=None: started.append(run.world.size) or 0)
    assert main_in_process("bench", "--preset", "tiny", "--tp-world", "2", "--prompt-tokens", "64", "--max-new-tokens", "1", "--calibration", out) == 0
    assert started == [2]


@pytest.mark.parametrize(
    "command,flags",
    [
        ("calibrate", ["--pin-slices", "2"]),
        ("calibrate", ["--overlap-policy", "rule"]),
        ("calibrate", ["--calibration", "cal.json"]),
        ("calibrate", ["--phase-profile"]),
        ("sweep", ["--pin-slices", "2"]),
        ("sweep", ["--overlap-policy", "rule"]),
    ],
    ids=lambda v: v if isinstance(v, str) else v[0],
)
def test_flags_a_command_would_ignore_are_not_its_flags(command, flags, capsys, no_ranks):
    # calibrate times every --pin count under no policy and profiles nothing; sweep times its own
    # --pin counts and names its own --policy. Neither takes the shared flags it would ignore.
    usage_error_in_process(capsys, command, "--preset", "tiny", *flags, *(["--out", "c.json"] if command == "calibrate" else []), expect=f"unrecognized arguments: {flags[0]}")


def test_one_rank_runs_beside_an_exported_calibration_and_says_it_is_unused(tmp_path, capsys, monkeypatch):
    # Made for TP=2 and another dtype: nothing a single rank does depends on it (it slices nothing),
    # and no calibration can be made for one rank, so it is noted, not refused.
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(GOOD))
    monkeypatch.setenv("POCKETLLM_CALIBRATION", str(path))
    assert main_in_process("generate", "--preset", "tiny", "--dtype", "float32", "--token-ids", "1,2", "--max-new-tokens", 1) == 0
    assert f"calibration {path} unused: one rank has no all-reduce to overlap" in capsys.readouterr().err

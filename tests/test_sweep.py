"""`pocketllm sweep`: the interleaving order, the tables, summary and plot from synthetic timings,
bad lists, and a real tiny sweep at TP=2 whose runs each ran their setting's slice count."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, usage_error_in_process
from pocketllm.bench.sweep_report import Setting, format_report, pinned, summarize
from pocketllm.commands.sweep import sweep_order

SETTINGS = [pinned(1), pinned(4), pinned(8), Setting("rule", None), Setting("calibrated", None)]
# Mean prefill TPS per (rows, setting) and the slices each setting resolved to: a 910A-like shape.
MEANS = {
    512: {"pin=1": (875.8, 1), "pin=4": (431.4, 4), "pin=8": (431.0, 8), "rule": (878.8, 1), "calibrated": (870.0, 1)},
    4096: {"pin=1": (1205.2, 1), "pin=4": (1265.2, 4), "pin=8": (1200.0, 8), "rule": (1261.6, 4), "calibrated": (1205.0, 1)},
}


def _records(reps: int = 3) -> list[dict]:
    out = []
    for rep, rows, name in sweep_order(list(MEANS), [s.name for s in SETTINGS], reps):
        mean, slices = MEANS[rows][name]
        # Reps spread -1%, 0, +1% around the mean, so the mean is exact.
        tps = mean * (1 + 0.01 * (rep - 2))
        out.append({
            "rep": rep, "rows": rows, "setting": name, "slices": slices, "serial": name == "pin=8" and rows < 8,
            "prefill_tokens_per_s": tps, "decode_tokens_per_s": 8.7 + 0.1 * rep,
        })
    return out


def test_interleaving_is_rep_major_in_a_fixed_order():
    order = sweep_order([512, 4096], ["pin=1", "rule"], 2)
    assert order == [
        (1, 512, "pin=1"), (1, 512, "rule"), (1, 4096, "pin=1"), (1, 4096, "rule"),
        (2, 512, "pin=1"), (2, 512, "rule"), (2, 4096, "pin=1"), (2, 4096, "rule"),
    ]
    # Every (rows, setting) once per rep, and no rep starts before the previous one ends.
    order = sweep_order([1, 2, 3], ["a", "b", "c"], 3)
    assert [r for r, _, _ in order] == sorted(r for r, _, _ in order)
    assert len(set(order)) == 27


def test_summary_from_synthetic_timings():
    report = summarize(_records(), list(MEANS), SETTINGS)
    assert report["best"]["512"]["slices"] == 1 and report["best"]["4096"]["slices"] == 4
    rule, cal = report["summary"]["rule"], report["summary"]["calibrated"]
    assert rule["512"]["slices"] == 1 and rule["512"]["ratio_to_best"] == pytest.approx(878.8 / 875.8, abs=1e-4)
    assert rule["4096"]["slices"] == 4 and rule["4096"]["ratio_to_best"] == pytest.approx(1261.6 / 1265.2, abs=1e-4)
    assert cal["4096"]["ratio_to_best"] == pytest.approx(1205.0 / 1265.2, abs=1e-4)


def test_tables_from_synthetic_timings():
    lines, _ = format_report(_records(), list(MEANS), SETTINGS)
    text = "\n".join(lines)
    assert "rows=512: prefill TPS per rep" in text and "rows=4096: prefill TPS per rep" in text
    pin4 = next(line for line in lines if line.startswith("pin=4") and "431" in line)
    assert pin4.split() == ["pin=4", "4", f"{431.4 * 0.99:.1f}", "431.4", f"{431.4 * 1.01:.1f}", "431.4"]
    assert "best pinned count against each policy's choice" in text
    assert "decode TPS 8.80..9.00 over all 30 runs" in text
    # The last line is each policy's choice and its prefill TPS over the best pin's, per row count.
    last = json.loads(lines[-1])
    best = {"512": 875.8, "4096": 1265.2}
    expected = {p: {str(rows): (MEANS[rows][p][1], MEANS[rows][p][0] / best[str(rows)]) for rows in MEANS} for p in ("rule", "calibrated")}
    assert set(last) == {"summary"} and set(last["summary"]) == set(expected)
    for policy, by_rows in expected.items():
        assert set(last["summary"][policy]) == set(by_rows)
        for rows, (slices, ratio) in by_rows.items():
            got = last["summary"][policy][rows]
            assert got["slices"] == slices and got["ratio_to_best"] == pytest.approx(ratio, abs=1e-3), (policy, rows, got)


def test_fallback_to_serial_is_marked():
    records = [
        {"rep": 1, "rows": 4, "setting": "pin=8", "slices": 1, "serial": True, "prefill_tokens_per_s": 10.0, "decode_tokens_per_s": 1.0},
        {"rep": 1, "rows": 4, "setting": "pin=1", "slices": 1, "serial": True, "prefill_tokens_per_s": 10.0, "decode_tokens_per_s": 1.0},
    ]
    lines, _ = format_report(records, [4], [pinned(1), pinned(8)])
    assert "(fell back to serial)" in next(line for line in lines if line.startswith("pin=8"))
    assert "fell back" not in next(line for line in lines if line.startswith("pin=1"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rows", ""], "--rows is empty"),
        (["--rows", "512,abc"], "--rows: 'abc' is not an integer"),
        (["--pin", "1,0"], "--pin: 0 must be a positive integer"),
        (["--policy", "rule,best"], "--policy: 'best' is not one of rule, calibrated"),
        (["--policy", "calibrated"], "--policy calibrated needs --calibration"),
        # matplotlib would refuse the name only after the whole sweep.
        (["--plot", "sweep.txt"], "--plot sweep.txt: the plot is written as a PNG; give a name ending in .png"),
    ],
)
def test_bad_lists_exit_2(args, message, capsys, no_ranks):
    usage_error_in_process(capsys, "sweep", "--preset", "tiny", "--tp-world", "2", *args, expect=message)


def test_tiny_sweep_at_tp2_end_to_end(tmp_path):
    out = tmp_path / "sweep.json"
    r = run_cli(
        "sweep", "--preset", "tiny", "--tp-world", "2", "--rows", "3,32", "--pin", "1,4", "--reps", "2",
        "--max-new-tokens", "2", "--warmup-tokens", "4", "--json", out, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [(r["rep"], r["rows"], r["setting"]) for r in runs] == sweep_order([3, 32], ["pin=1", "pin=4", "rule"], 2)
    for run in runs:
        # Each run timed the prefill of its rows under its own setting's slice count (the rule
        # slices neither 3 nor 32 rows on the tiny shape, and a pin of 4 runs 3 rows serial): one
        # all-reduce per slice at each of the 4 layers' mlp.down and mixer output projections, and
        # the embedding's.
        want = {"pin=1": 1, "pin=4": 4 if run["rows"] >= 4 else 1, "rule": 1}[run["setting"]]
        assert (run["slices"], run["collectives"], run["serial"]) == (want, 8 * want + 1, want == 1), run
        assert run["prefill_tokens"] == run["rows"] and run["decode_tokens"] == 2
        assert run["prefill_tokens_per_s"] == pytest.approx(run["rows"] / run["prefill_seconds"])
        assert run["decode_tokens_per_s"] == pytest.approx(2 / run["decode_seconds"])
    # The summary sets the rule's mean prefill TPS against the best pin's, from these runs.
    summary = json.loads(r.stdout.strip().splitlines()[-1])["summary"]
    for rows in (3, 32):
        mean = {s: sum(r["prefill_tokens_per_s"] for r in runs if (r["rows"], r["setting"]) == (rows, s)) / 2 for s in ("pin=1", "pin=4", "rule")}
        best = max(("pin=1", "pin=4"), key=mean.get)
        assert data["best"][str(rows)]["slices"] == int(best[4:])
        assert summary["rule"][str(rows)] == {"slices": 1, "ratio_to_best": pytest.approx(mean["rule"] / mean[best], abs=1e-4)}
        assert data["summary"]["rule"][str(rows)]["ratio_to_best"] == summary["rule"][str(rows)]["ratio_to_best"]
    assert data["settings"]["tp_world"] == 2 and data["settings"]["settings"]["pin=4"] == "pinned at 4"
    # Progress went to stderr, the tables to stdout.
    assert "rows=3: prefill TPS per rep" in r.stdout and "rep 2/2" in r.stderr
    pin4 = next(line for line in r.stdout.splitlines()[r.stdout.splitlines().index("rows=3: prefill TPS per rep"):] if line.startswith("pin=4"))
    assert pin4.split()[1] == "1" and pin4.endswith("(fell back to serial)"), pin4


def test_the_plot_shows_each_pins_reps_and_each_policys_choice(tmp_path, monkeypatch):
    # The picture from the synthetic timings: a line per pin through its mean TPS at each row
    # count, bars to its reps' min and max, and the policies' choices marked where they ran.
    import matplotlib.pyplot as plt

    from pocketllm.bench.plot import plot_sweep

    figures = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1])
    png = tmp_path / "sweep.png"
    plot_sweep(_records(), list(MEANS), SETTINGS, str(png), "tiny")
    assert png.stat().st_size > 0
    (fig, ax), = figures
    pins = {c.get_label(): c for c in ax.containers}
    assert set(pins) == {"1 slice", "4 slices", "8 slices"}
    for pin in (1, 4, 8):
        line, _, (bars,) = pins[f"{pin} slice" + ("s" if pin > 1 else "")].lines
        assert list(line.get_xdata()) == [512, 4096]
        assert list(line.get_ydata()) == pytest.approx([MEANS[512][f"pin={pin}"][0], MEANS[4096][f"pin={pin}"][0]])
        # The bars span the reps: -1% to +1% of the mean.
        mean = MEANS[512][f"pin={pin}"][0]
        assert tuple(bars.get_segments()[0][:, 1]) == pytest.approx((mean * 0.99, mean * 1.01))
    marks = {line.get_label(): line for line in ax.get_lines() if line.get_label().endswith("'s choice")}
    for policy in ("rule", "calibrated"):
        assert list(marks[f"{policy}'s choice"].get_ydata()) == pytest.approx([MEANS[512][policy][0], MEANS[4096][policy][0]])
    assert [t.get_text() for t in ax.texts] == ["r1", "r4", "c1", "c1"]


def test_plot_without_matplotlib_is_one_clear_line(monkeypatch):
    import importlib.util

    from pocketllm.bench import plot
    from pocketllm.errors import UsageError

    real = importlib.util.find_spec
    monkeypatch.setattr(plot.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(UsageError, match=r"--plot needs matplotlib, which is not installed; pip install 'pocketllm\[plot\]'"):
        plot.require_matplotlib()

"""The slice sweep's tables and summary, built from its per-run records alone (seed sections 3-4):
per row count each setting's per-rep prefill TPS and mean; then the best pinned count against each
policy's choice; then decode TPS over every run as the drift bound.

A record is a dict with at least rep, rows, setting, slices, serial, prefill_tokens_per_s and
decode_tokens_per_s, one per timed (rep, rows, setting)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str  # "pin=4", "rule", "calibrated"
    pin: int | None  # the pinned count; None for a named policy

    @property
    def is_policy(self) -> bool:
        return self.pin is None


def pinned(slices: int) -> Setting:
    return Setting(f"pin={slices}", slices)


def runs_of(records: list[dict], rows: int, setting: str) -> list[dict]:
    return sorted((r for r in records if r["rows"] == rows and r["setting"] == setting), key=lambda r: r["rep"])


def mean_of(runs: list[dict]) -> float:
    """The mean prefill tokens/s of runs."""
    return statistics.fmean(r["prefill_tokens_per_s"] for r in runs)


def mean_tps(records: list[dict], rows: int, setting: str) -> float:
    return mean_of(runs_of(records, rows, setting))


def summarize(records: list[dict], rows_list: list[int], settings: list[Setting]) -> dict:
    """{"best": {ROWS: {"slices", "mean_tps"}}, "summary": {POLICY: {ROWS: {"slices", "ratio_to_best", "mean_tps"}}}},
    row counts as strings (JSON keys). The best pinned count is the highest mean."""
    pins = [s for s in settings if not s.is_policy]
    best, summary = {}, {s.name: {} for s in settings if s.is_policy}
    for rows in rows_list:
        top = max(pins, key=lambda s: mean_tps(records, rows, s.name)) if pins else None
        top_tps = mean_tps(records, rows, top.name) if top else None
        if top:
            best[str(rows)] = {"slices": top.pin, "mean_tps": top_tps}
        for s in settings:
            if not s.is_policy:
                continue
            tps = mean_tps(records, rows, s.name)
            summary[s.name][str(rows)] = {
                "slices": runs_of(records, rows, s.name)[0]["slices"],
                "ratio_to_best": round(tps / top_tps, 4) if top_tps else None,
                "mean_tps": tps,
            }
    return {"best": best, "summary": summary}


def drift_bound(records: list[dict]) -> tuple[float, float]:
    decode = [r["decode_tokens_per_s"] for r in records]
    return min(decode), max(decode)


def per_rows_table(records: list[dict], rows: int, settings: list[Setting]) -> list[str]:
    reps = max(r["rep"] for r in records)
    head = f"{'setting':<12}{'slices':>7}" + "".join(f"{'rep ' + str(i + 1):>10}" for i in range(reps)) + f"{'mean':>10}"
    lines = [f"rows={rows}: prefill TPS per rep", head]
    for s in settings:
        runs = runs_of(records, rows, s.name)
        cells = "".join(f"{r['prefill_tokens_per_s']:>10.1f}" for r in runs)
        mark = "   (fell back to serial)" if s.pin is not None and s.pin > 1 and runs[0]["serial"] else ""
        lines.append(f"{s.name:<12}{runs[0]['slices']:>7}{cells}{mean_tps(records, rows, s.name):>10.1f}{mark}")
    return lines


def choice_table(report: dict, rows_list: list[int], settings: list[Setting]) -> list[str]:
    policies = [s.name for s in settings if s.is_policy]
    head = f"{'rows':<7}{'best pinned':>12}{'mean TPS':>10}" + "".join(f"{p + ' slices':>20}{'mean TPS':>10}{'ratio':>8}" for p in policies)
    lines = ["best pinned count against each policy's choice", head]
    for rows in rows_list:
        b = report["best"].get(str(rows))
        line = f"{rows:<7}{b['slices']:>12}{b['mean_tps']:>10.1f}" if b else f"{rows:<7}{'-':>12}{'-':>10}"
        for p in policies:
            c = report["summary"][p][str(rows)]
            ratio = f"{c['ratio_to_best']:>8.3f}" if c["ratio_to_best"] is not None else f"{'-':>8}"
            line += f"{c['slices']:>20}{c['mean_tps']:>10.1f}{ratio}"
        lines.append(line)
    return lines


def summary_line(report: dict) -> str:
    """The last line of a sweep: {"summary": {POLICY: {"ROWS": {"slices": S, "ratio_to_best": r}}}}."""
    slim = {p: {rows: {"slices": c["slices"], "ratio_to_best": c["ratio_to_best"]} for rows, c in by_rows.items()} for p, by_rows in report["summary"].items()}
    return json.dumps({"summary": slim}, sort_keys=False)


def format_report(records: list[dict], rows_list: list[int], settings: list[Setting]) -> tuple[list[str], dict]:
    """Every line a sweep prints, the JSON summary last, and the report dict behind them."""
    report = summarize(records, rows_list, settings)
    lines: list[str] = []
    for rows in rows_list:
        lines += per_rows_table(records, rows, settings) + [""]
    lines += choice_table(report, rows_list, settings) + [""]
    lo, hi = drift_bound(records)
    lines.append(
        f"decode TPS {lo:.2f}..{hi:.2f} over all {len(records)} runs: the drift bound "
        "(decode takes the serial path at every setting, so a prefill difference larger than this spread is not drift)"
    )
    lines.append(summary_line(report))
    return lines, report

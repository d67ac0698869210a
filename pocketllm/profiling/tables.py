"""The seed's section 5.2 and 5.3 tables, built from one phase block per prompt length.

5.2: per length the wall (prefill_seconds), STACK, prefill TPS, and every scope in seconds and % of
STACK, with the per-site sub-totals indented under their scope. 5.3: the all-reduce priced from
the same blocks, us per call against MB per call, with a two-point fit on the shortest and longest
lengths (a fixed term in ms and a marginal GB/s) and the fit's error on every point in between.
"""

from __future__ import annotations

from pocketllm.profiling.scopes import STACK

COLLECTIVE = "tp_all_reduce"
# The scopes the attribution table shows per rank: a rank that waited for a slower one shows it
# as collective (or skew) time.
RANK_VIEW_SCOPES = (STACK, COLLECTIVE, "tp_skew")


def _calls_label(values: list[int]) -> str:
    distinct = sorted(set(values))
    return str(distinct[0]) if len(distinct) == 1 else "/".join(map(str, values))


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows)


def attribution_rows(runs: list[dict]) -> list[list[str]]:
    """runs: [{"prompt_tokens", "prefill_seconds", "block"(, "walls")}] in column order; the
    wall row is the chosen rep's, the one its block measured."""
    blocks = [r["block"] for r in runs]
    rows = [
        ["prompt tokens"] + [str(r["prompt_tokens"]) for r in runs],
        ["block (rank 0)"] + [str(b["block"]) for b in blocks],
        ["wall (prefill_seconds)"] + [f"{r['prefill_seconds']:.4f}" for r in runs],
        ["STACK"] + [f"{b['stack_seconds']:.4f}" for b in blocks],
        ["prefill TPS"] + [f"{r['prompt_tokens'] / r['prefill_seconds']:.1f}" for r in runs],
    ]
    if any(len(r.get("walls", ())) > 1 for r in runs):
        rows.insert(3, ["wall over reps (min..max)"] + [f"{min(r['walls']):.4f}..{max(r['walls']):.4f}" for r in runs])
    last = blocks[-1]["scopes"]
    names = [n for n in last if n != STACK] + sorted({n for b in blocks for n in b["scopes"]} - set(last) - {STACK})

    def cell(entry: dict | None) -> str:
        if entry is None:
            return "-"
        share = entry.get("share")
        pct = "" if share is None else f" ({100 * share:.1f}%)"
        return f"{entry['seconds']:.4f}{pct}"

    for name in names:
        entries = [b["scopes"].get(name) for b in blocks]
        calls = _calls_label([e["calls"] if e else 0 for e in entries])
        rows.append([f"{name} ({calls})"] + [cell(e) for e in entries])
        sites = [n for n in (last.get(name) or {}).get("sites", {})]
        for e in entries:
            for s in (e or {}).get("sites", {}):
                if s not in sites:
                    sites.append(s)
        for site in sites:
            subs = [(e or {}).get("sites", {}).get(site) for e in entries]
            rows.append([f"  {site} ({_calls_label([s['calls'] if s else 0 for s in subs])})"] + [cell(s) for s in subs])
    if all(len(r.get("ranks", ())) > 1 for r in runs):
        # The same pass on every rank: the spread between ranks is skew, not collective cost.
        for name in RANK_VIEW_SCOPES:
            if any(v[name] for r in runs for v in r["ranks"]):
                rows.append([f"{name} by rank"] + [" / ".join(f"{v[name]:.4f}" for v in r["ranks"]) for r in runs])
    total = [sum(e["share"] or 0.0 for n, e in b["scopes"].items() if n != STACK) for b in blocks]
    rows.append(["sum of scope shares"] + [f"{100 * t:.1f}%" for t in total])
    return rows


def attribution_table(runs: list[dict]) -> str:
    return _grid(attribution_rows(runs))


def collective_points(runs: list[dict], hidden: int, elem_bytes: int, sites_per_pass: int) -> list[dict]:
    """us per all-reduce and MB (1e6 bytes) per all-reduce at each length. Slicing splits each
    site's rows over more calls, so bytes per call is the pass's total over its call count."""
    points = []
    for r in runs:
        entry = r["block"]["scopes"].get(COLLECTIVE)
        if not entry or not entry["calls"]:
            continue
        total_bytes = sites_per_pass * r["prompt_tokens"] * hidden * elem_bytes
        points.append(
            {
                "rows": r["prompt_tokens"],
                "calls": entry["calls"],
                "seconds": entry["seconds"],
                "us_per_call": 1e6 * entry["seconds"] / entry["calls"],
                "mb_per_call": total_bytes / entry["calls"] / 1e6,
            }
        )
    return points


def two_point_fit(points: list[dict]) -> dict | None:
    """us/call = fixed + MB/call * slope through the shortest and the longest point, and the
    error of that line at every point between them."""
    if len(points) < 2:
        return None
    a, b = points[0], points[-1]
    if b["mb_per_call"] == a["mb_per_call"]:
        return None
    slope = (b["us_per_call"] - a["us_per_call"]) / (b["mb_per_call"] - a["mb_per_call"])  # us per MB
    fixed_us = a["us_per_call"] - slope * a["mb_per_call"]
    checks = []
    for p in points[1:-1]:
        predicted = fixed_us + slope * p["mb_per_call"]
        checks.append({"rows": p["rows"], "predicted_us": predicted, "measured_us": p["us_per_call"], "error": predicted / p["us_per_call"] - 1})
    # 1 MB per us is 1000 GB/s; a flat or falling line has no byte term to price.
    gbps = 1000.0 / slope if slope > 0 else None
    return {"fixed_ms": fixed_us / 1000.0, "us_per_mb": slope, "gb_per_s": gbps, "checks": checks}


def collective_table(points: list[dict], fit: dict | None) -> str:
    if not points:
        return "no all-reduce was timed (TP=1 has no collectives)"
    rows = [["rows", "calls", "us/call", "MB/call"]]
    rows += [[str(p["rows"]), str(p["calls"]), f"{p['us_per_call']:.1f}", f"{p['mb_per_call']:.3f}"] for p in points]
    text = _grid(rows)
    if fit is None:
        return text + "\nfit: needs two prompt lengths with different payloads"
    rate = f"{fit['gb_per_s']:.2f} GB/s" if fit["gb_per_s"] is not None else "no byte term (us/call does not grow with payload)"
    lines = [text, f"two-point fit on rows {points[0]['rows']} and {points[-1]['rows']}: fixed {fit['fixed_ms']:.4f} ms per call, marginal {rate}"]
    if fit["fixed_ms"] < 0:
        lines.append("  a negative fixed term: the two ends do not lie on one line through the origin side (noise, or a cost that is not linear in bytes)")
    for c in fit["checks"]:
        lines.append(f"  at rows {c['rows']}: predicts {c['predicted_us']:.1f} us, measured {c['measured_us']:.1f} us ({100 * c['error']:+.1f}%)")
    return "\n".join(lines)

"""The slice sweep as a picture: prefill TPS against rows, one line per pinned slice count with
error bars spanning its reps, and a marker on each policy's choice. matplotlib is an optional
extra (`pip install 'pocketllm[plot]'`)."""

from __future__ import annotations

import importlib.util

from pocketllm.bench.sweep_report import Setting, mean_of, runs_of
from pocketllm.errors import UsageError

POLICY_MARKERS = {"rule": ("o", 13), "calibrated": ("*", 15)}


def require_matplotlib(flag: str = "--plot") -> None:
    """Checked before any measuring, so a missing extra does not cost a whole sweep."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"{flag} needs matplotlib, which is not installed; pip install 'pocketllm[plot]' or drop {flag}")


def plot_sweep(records: list[dict], rows_list: list[int], settings: list[Setting], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in settings:
        if s.is_policy:
            continue
        means, low, high = [], [], []
        for rows in rows_list:
            runs = runs_of(records, rows, s.name)
            tps = [r["prefill_tokens_per_s"] for r in runs]
            mean = mean_of(runs)
            means.append(mean)
            low.append(mean - min(tps))
            high.append(max(tps) - mean)
        ax.errorbar(rows_list, means, yerr=[low, high], marker=".", capsize=3, label=f"{s.pin} slice{'s' if s.pin > 1 else ''}")
    for s in settings:
        if not s.is_policy:
            continue
        marker, size = POLICY_MARKERS.get(s.name, ("D", 10))
        xs, ys, labels = [], [], []
        for rows in rows_list:
            runs = runs_of(records, rows, s.name)
            xs.append(rows)
            ys.append(mean_of(runs))
            labels.append(runs[0]["slices"])
        ax.plot(xs, ys, linestyle="none", marker=marker, markersize=size, markerfacecolor="none", markeredgewidth=1.5, label=f"{s.name}'s choice")
        for x, y, k in zip(xs, ys, labels):
            ax.annotate(f"{s.name[0]}{k}", (x, y), textcoords="offset points", xytext=(6, -12 if s.name == "rule" else 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows_list, [str(r) for r in rows_list])
    ax.set_xlabel("prompt rows (prefill)")
    ax.set_ylabel("prefill tokens/s (mean of reps; bars: min..max)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

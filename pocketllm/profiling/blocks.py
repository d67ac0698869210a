"""One report block per pass, and what identifies it.

A block says which pass it measured (a block id unique in the run, the rank, the kind, the rows,
whether it is a bench's timed pass, the slice count and path) before any number, so a reader finds
the timed prefill by a field and never by matching numbers (the mistake seed section 8 warns of).
Every text line of a block carries the block id and rank, so even a flat grep cannot mix blocks.

Two views of the same scope tree: the phase block (device-synced, exclusive seconds per scope
with shares of STACK) and the host block (wall clock, inclusive and self seconds per span).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pocketllm.profiling.scopes import STACK

NS = 1e-9


@dataclass
class BlockId:
    block: int
    rank: int
    kind: str  # warmup, prefill or decode
    rows: int
    timed: bool
    slices: int
    path: str  # serial, overlapped, or overlapped-serialised (a phase profile waits each slice)
    collectives: dict[str, int] = field(default_factory=dict)  # the engine's all-reduces per site


def header(block: dict) -> str:
    """A block's identity as the first fields of its text header, read from the block itself."""
    return (
        f"block={block['block']} rank={block['rank']} kind={block['kind']} rows={block['rows']} timed={int(block['timed'])} "
        f"slices={block['slices']} path={block['path']}"
    )


def _site_name(name: str, site: str | None) -> str:
    return name if site is None else f"{name}/{site}"


def phase_block(ident: BlockId, stats: dict, wall_ns: int) -> dict:
    """Exclusive seconds, calls and share of STACK per scope name, with per-site sub-totals.
    STACK itself is reported inclusive (the denominator); its own exclusive time is `other`."""
    stack_ns = stats.get((STACK, None), [0, 0, 0])[1]
    scopes: dict[str, dict] = {}
    for (name, site), (excl, _incl, calls) in stats.items():
        if name == STACK:
            continue
        entry = scopes.setdefault(name, {"ns": 0, "calls": 0, "sites": {}})
        entry["ns"] += excl
        entry["calls"] += calls
        if site is not None:
            entry["sites"][site] = {"ns": excl, "calls": calls}
    if (STACK, None) in stats:
        excl, _incl, calls = stats[(STACK, None)]
        scopes["other"] = {"ns": excl, "calls": calls, "sites": {}}

    def share(ns: int):
        return ns / stack_ns if stack_ns else None

    out = {}
    if (STACK, None) in stats:
        out[STACK] = {"seconds": stack_ns * NS, "calls": stats[(STACK, None)][2], "share": 1.0}
    for name, e in sorted(scopes.items(), key=lambda kv: -kv[1]["ns"]):
        row = {"seconds": e["ns"] * NS, "calls": e["calls"], "share": share(e["ns"])}
        if e["sites"]:
            row["sites"] = {
                site: {"seconds": s["ns"] * NS, "calls": s["calls"], "share": share(s["ns"])}
                for site, s in sorted(e["sites"].items(), key=lambda kv: -kv[1]["ns"])
            }
        out[name] = row
    return {**asdict(ident), "wall_seconds": wall_ns * NS, "stack_seconds": stack_ns * NS, "scopes": out}


def host_block(ident: BlockId, stats: dict, wall_ns: int) -> dict:
    """Inclusive and self seconds per span (name/site); the self times add up to at most the
    wall because they partition the time spent inside the outermost spans."""
    spans = {}
    self_total = 0
    for (name, site), (excl, incl, calls) in sorted(stats.items(), key=lambda kv: -kv[1][0]):
        self_total += excl
        spans[_site_name(name, site)] = {"inclusive_seconds": incl * NS, "self_seconds": excl * NS, "calls": calls}
    return {**asdict(ident), "wall_seconds": wall_ns * NS, "self_total_seconds": self_total * NS, "spans": spans}


def _share(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def phase_text(block: dict) -> str:
    """`qwen_phase block=...` then one `scope=` line per scope and one `site=` line per sub-total.
    Sites are on their own key so that summing the scope= lines never counts a second twice."""
    tag = f"block={block['block']} rank={block['rank']}"
    total_collectives = sum(block["collectives"].values())
    lines = [f"qwen_phase {header(block)} wall_seconds={block['wall_seconds']:.6f} collectives={total_collectives}"]
    for name, s in block["scopes"].items():
        lines.append(f"scope={name} seconds={s['seconds']:.6f} calls={s['calls']} share={_share(s['share'])} {tag}")
    for name, s in block["scopes"].items():
        for site, t in s.get("sites", {}).items():
            lines.append(f"site={name}/{site} seconds={t['seconds']:.6f} calls={t['calls']} share={_share(t['share'])} {tag}")
    return "\n".join(lines) + "\n"


def host_text(block: dict) -> str:
    tag = f"block={block['block']} rank={block['rank']}"
    lines = [
        f"qwen_host {header(block)} wall_seconds={block['wall_seconds']:.6f} "
        f"self_total_seconds={block['self_total_seconds']:.6f}"
    ]
    for name, s in block["spans"].items():
        lines.append(
            f"span={name} inclusive_seconds={s['inclusive_seconds']:.6f} self_seconds={s['self_seconds']:.6f} "
            f"calls={s['calls']} {tag}"
        )
    return "\n".join(lines) + "\n"

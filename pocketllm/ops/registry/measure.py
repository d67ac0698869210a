"""Timing candidates on probe weights, the way a real pass runs them.

A "stream" kind is timed on the model's own weights in the order a step reads them, so each call
finds its weight out of cache as in a real step (a kernel timed on one hot weight would be timed
on the cache, not on memory); a "widest" kind on one probe cut from the widest weight, with
PROBE_ROWS rows of x. Passes alternate the order of the kernels timed, and each kernel's fastest
pass decides: another process only ever adds time, so a minimum is what the kernel can do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from pocketllm.ops.registry.kinds import Kind, activation_dtype, one_row, weight_bytes, weight_rows

# Enough weights per pass that the pass streams from memory, yet a 64-layer model is not read
# dozens of times over at load: each shape's weights are taken in step order up to its share.
PASS_BYTES = 1 << 30
# The widest kind's probe: this many rows of x against up to PROBE_OUT rows of the weight.
PROBE_ROWS = 256
PROBE_OUT = 1024
# A candidate whose prepared form is a second copy of the weight (Candidate.copies) is timed on
# copies of at most this many bytes together: each call's weight cut to its first rows in the
# same proportion, its time scaled up to the whole weight. A pass over a big model's weights
# would otherwise hold a second copy of a gigabyte of them while it is timed.
COPY_BYTES = 256 << 20


@dataclass
class Call:
    key: object  # what the choice is per: a weight shape (out, in), or the probe's label
    weight: object
    x: torch.Tensor
    out: torch.Tensor  # x [in] and out [out] for one row; x [m, in] and out [m, out] for more


def probe_label(w) -> str:
    out, cols = w.shape
    return f"{PROBE_ROWS}x{cols} @ {cols}x{min(out, PROBE_OUT)}"


def key_of(kind: Kind, w):
    """The key a weight's choice is kept under in `kind`."""
    return tuple(w.shape) if kind.probe == "stream" else "probe"


def calls_for(kind: Kind, weights: list, rows: int, budget: int = PASS_BYTES) -> list[Call]:
    """The calls one pass makes: for a stream kind the weights of each shape in step order, each
    shape keeping at least one and none more than its share of `budget`; for a widest kind one
    call on the probe."""
    dtype = activation_dtype(weights[0])
    if kind.probe != "stream":
        w = max(weights, key=lambda t: t.shape[1])
        probe = weight_rows(w, 0, min(w.shape[0], PROBE_OUT))
        x = torch.randn(PROBE_ROWS, w.shape[1], dtype=dtype)
        return [Call("probe", probe, x, torch.empty(PROBE_ROWS, probe.shape[0], dtype=dtype))]
    shapes = {tuple(w.shape) for w in weights}
    taken = dict.fromkeys(shapes, 0)
    chosen = []
    for w in weights:
        s = tuple(w.shape)
        if taken[s] == 0 or taken[s] < budget // len(shapes):
            chosen.append(w)
            taken[s] += weight_bytes(w)
    lead = () if one_row(rows) else (rows,)
    xs = {s: torch.randn(*lead, s[1], dtype=dtype) for s in shapes}
    outs = {s: torch.empty(*lead, s[0], dtype=dtype) for s in shapes}
    return [Call(tuple(w.shape), w, xs[tuple(w.shape)], outs[tuple(w.shape)]) for w in chosen]


def copy_rows(weights) -> dict[int, int]:
    """id(weight) -> the rows a copying candidate is timed on (COPY_BYTES over them all)."""
    unique = {id(w): w for w in weights}
    share = min(1.0, COPY_BYTES / max(1, sum(weight_bytes(w) for w in unique.values())))
    return {i: max(1, min(w.shape[0], math.ceil(w.shape[0] * share))) for i, w in unique.items()}


def prepared_forms(kind: Kind, names, weights) -> dict[str, dict[int, object]]:
    """name -> {id(weight): the form that kernel runs}: the weight itself, or what its candidate's
    prepare made of it (made once per layout, shared by candidates that declare the same); a
    copying candidate's of the weight's first copy_rows() rows."""
    by_layout: dict[str, dict[int, object]] = {}
    out = {}
    cut = copy_rows(weights)
    for name in names:
        cand = kind.by_name[name]
        if cand.prepare is None:
            out[name] = {id(w): w for w in weights}
            continue
        layout = cand.layout or name
        if layout not in by_layout:
            by_layout[layout] = {id(w): cand.prepare(weight_rows(w, 0, cut[id(w)]) if cand.copies else w) for w in weights}
        out[name] = by_layout[layout]
    return out


def time_calls(kind: Kind, calls: list[Call], slots: dict, passes: int, warm: bool = True, min_seconds: float = 0.0, max_passes: int = 0) -> dict:
    """Seconds per call {key: {name: s}}, each the fastest pass's mean over that key's calls.
    slots[key] lists the kernels to time on that key; pass j-th runs every key's j-th kernel, the
    order of j reversed every other pass. At least `passes` passes, more (up to max_passes) while
    the timing has lasted less than min_seconds; always an even number."""
    width = max(len(v) for v in slots.values())
    names = list(dict.fromkeys(n for v in slots.values() for n in v))
    forms = prepared_forms(kind, names, [c.weight for c in calls])
    runs = {n: kind.by_name[n].run for n in names}
    # A copying candidate writes the rows of its cut weight into an output of their own, and its
    # time counts for the whole weight.
    cut = copy_rows([c.weight for c in calls]) if any(kind.by_name[n].copies for n in names) else {}
    outs, scale = {}, {}
    for c in calls:
        rows = cut.get(id(c.weight), c.weight.shape[0])
        outs[id(c)] = c.out if rows == c.weight.shape[0] else torch.empty(*c.out.shape[:-1], rows, dtype=c.out.dtype)
        scale[id(c)] = c.weight.shape[0] / rows

    def out_for(n: str, c: Call):
        return (outs[id(c)], scale[id(c)]) if kind.by_name[n].copies else (c.out, 1.0)

    if warm:
        # One untimed call of each kernel first: the first call of a kernel pays for its setup.
        for n in names:
            for c in calls:
                runs[n](c.x, forms[n][id(c.weight)], out_for(n, c)[0])
    best: dict = {}
    clock = time.perf_counter
    t_start, p = clock(), 0
    while p < passes or (p < max_passes and clock() - t_start < min_seconds) or p % 2:
        for j in range(width) if p % 2 == 0 else reversed(range(width)):
            sums: dict = {}
            for c in calls:
                names_k = slots[c.key]
                n = names_k[min(j, len(names_k) - 1)]
                w = forms[n][id(c.weight)]
                out, times = out_for(n, c)
                t0 = clock()
                runs[n](c.x, w, out)
                dt = (clock() - t0) * times
                total, count = sums.get((c.key, n), (0.0, 0))
                sums[(c.key, n)] = (total + dt, count + 1)
            for (k, n), (total, count) in sums.items():
                by = best.setdefault(k, {})
                by[n] = min(by.get(n, float("inf")), total / count)
        p += 1
    return best


"""How one kind's kernel is chosen for a model's weights: forced, read from the cache and checked,
or measured until the measurement can be trusted, and written only then."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from pocketllm import compiled
from pocketllm.errors import UsageError
from pocketllm.ops.registry import cache
from pocketllm.ops.registry.kinds import FEW, MANY, Kind, batch_invariant, weight_bytes, weight_device, weight_format
from pocketllm.ops.registry.measure import calls_for, key_of, probe_label, time_calls
from pocketllm.ops.registry.trust import Monitor, Verdict, implausible, read_rate_gbps

# Candidates this close to the fastest are a wash: it goes to the one earliest in the kind's
# preference order.
WASH = 0.03
# A measurement: at least PASSES passes, more (up to MAX_PASSES) until it has lasted MIN_SECONDS,
# long enough for the machine's counters to tell a disturbed window; up to ATTEMPTS of them while
# the machine is busy or the result implausible (the last only while they have taken less than
# RETRY_BUDGET_S: on a busy machine a big model's attempts are slow, and a user waits for each).
PASSES = 6
MAX_PASSES = 24
MIN_SECONDS = 0.3
ATTEMPTS = 3
RETRY_WAIT_S = 0.1
RETRY_BUDGET_S = 2.0
# The check of cached entries at load: every key's cached kernel against its runner-up in
# CHECK_PASSES alternated passes (no warm-up; more, up to CHECK_MAX_PASSES, until it has lasted
# CHECK_MIN_SECONDS, so that a busy machine shows), judged on keys where one of the two now takes
# at least CHECK_MIN_CALL_S a call (shorter calls are timer and dispatch noise in a few passes); it
# disagrees when the runner-up now wins by more than the wash plus CHECK_NOISE, or the cached
# kernel now runs more than CHECK_RATIO faster or slower than the cache says.
CHECK_PASSES = 4
CHECK_MAX_PASSES = 16
CHECK_MIN_SECONDS = 0.1
CHECK_MIN_CALL_S = 200e-6
CHECK_NOISE = 0.10
CHECK_RATIO = 1.5

NOT_CACHED_BUSY = "measured, machine busy: not cached"
NOT_CACHED_IMPLAUSIBLE = "measured, implausible: not cached"


@dataclass
class Choice:
    """One kind's kernel per key (weight shape, or the probe) for weights of one format."""

    kind: Kind
    fmt: str
    how: str  # "forced", "default", "cached", "measured", or one of those with what the trust checks found
    by_key: dict = field(default_factory=dict)
    # Seconds per call of each candidate on each key (its fastest pass), from the measurement
    # that made this choice.
    seconds: dict = field(default_factory=dict)
    rows: int = 1  # the row count a few-row choice is for
    note: str = ""  # what the trust checks saw, when they kept a measurement out of the cache
    probe: str = ""  # a widest kind's probe

    def kernel_for(self, w) -> str:
        return self.runs(key_of(self.kind, w))

    def runs(self, key) -> str:
        """The kernel weights of `key` run. A measured choice whose prepared form would be a second
        copy of the weight (held beside the loaded weight, which the other row classes run, it
        would double the weight's memory) gives way to the fastest measured candidate that runs
        the loaded layout, else the kind's default; forced, the copy is held as asked."""
        name = self.by_key.get(key, self.by_key.get("probe", self.kind.default))
        if not self.kind.by_name[name].copies or self.how == "forced":
            return name
        kept = {n: s for n, s in self.seconds.get(key, self.seconds.get("probe", {})).items() if not self.kind.by_name[n].copies}
        return min(kept, key=kept.get) if kept else self.kind.default

    @property
    def trusted(self) -> bool:
        return "not cached" not in self.how

    def label(self) -> str:
        prefix = "" if self.kind.family == "float" else f"{self.fmt} "
        if self.kind.rows == MANY:
            return f"{prefix}many-row GEMM"
        return f"{prefix}{'one-row' if self.kind.rows != FEW else f'{self.rows}-row'} kernels"

    def describe(self) -> str:
        how = self.how + (f"; {self.note}" if self.note else "")
        if self.kind.probe != "stream":
            kernel = self._shown("probe")
            timed = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in self.seconds.get("probe", {}).items())
            return f"{self.label()} ({how}): {kernel}" + (f" ({timed} on {self.probe})" if timed else "")
        shapes = sorted(self.by_key, key=lambda k: -k[0] * k[1])
        parts = ", ".join(f"{o}x{i} {self._shown((o, i))}" for o, i in shapes)
        sources = {s for name in set(self.by_key.values()) for s in self.kind.by_name[name].sources}
        forced = f" ({compiled.ENV_ISA}={compiled.isa()})" if compiled.isa() != "native" else ""
        built = f"; c built for {(self.kind.isa or _isa)()}{forced}" if sources else ""
        return f"{self.label()} ({how}): {parts}{built}"

    def _shown(self, key) -> str:
        name, runs = self.by_key.get(key, self.kind.default), self.runs(key)
        return name if name == runs else f"{runs} ({name} measured faster: it would hold a copy of the weights)"

    def to_json(self) -> dict:
        def k(key):
            return f"{key[0]}x{key[1]}" if isinstance(key, tuple) else self.probe or key

        return {
            "kind": self.kind.name, "format": self.fmt, "how": self.how, "note": self.note, "rows": self.rows,
            "by_key": {k(key): name for key, name in self.by_key.items()},
            "runs": {k(key): self.runs(key) for key in self.by_key},
            "seconds": {k(key): s for key, s in self.seconds.items()},
        }


def _isa() -> str:
    from pocketllm.ops.gemv.kernels import compiled_isa

    return compiled_isa()


def pick(kind: Kind, seconds: dict[str, float]) -> str:
    """The kernel to run from each candidate's measured seconds: the fastest, unless one earlier
    in the kind's preference order is within WASH of it."""
    best = min(seconds.values())
    for name in kind.prefer:
        if name in seconds and seconds[name] <= best * (1 + WASH):
            return name
    return min(seconds, key=seconds.get)


# What holds torch's CPU kernels to a narrower instruction set than the CPU's: its own kernels,
# oneDNN's (the bf16 GEMM) and MKL's (the fp32 GEMM, which ignores the other two).
TORCH_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine_parts(sources) -> list[str]:
    """What every measured choice depends on before its own terms: the CPU, torch, the builds it
    ran and the compiled kernels' sources (a choice measured against another version of them says
    nothing about this one)."""
    parts = [compiled.cpu_model(), f"torch {torch.__version__}"]
    # Builds narrower than the CPU's run other code than a choice measured without them: torch's
    # own kernels held back by these variables, and POCKETLLM_ISA's.
    parts += [f"{name}={os.environ[name]}" for name in TORCH_ISA_VARIABLES if os.environ.get(name)]
    parts += [f"{compiled.ENV_ISA}={compiled.isa()}"] if compiled.isa() != "native" else []
    return parts + [f"kernels {compiled.source_digest(s)}" for s in sorted(set(sources))]


def cache_key(kind: Kind, fmt: str, key, rows: int, label: str = "") -> str:
    parts = machine_parts(s for c in kind.candidates for s in c.sources)
    parts += [kind.name, fmt, f"{torch.get_num_threads()} threads", label or f"{key[0]}x{key[1]}"]
    return "|".join(parts + ([f"{rows} rows"] if rows > 1 else []))


def _valid(entry, names: list[str]) -> dict | None:
    """The entry's seconds if it is whole and sane: every available candidate timed, each a
    positive finite number, its kernel among them."""
    if not isinstance(entry, dict) or not isinstance(entry.get("seconds"), dict) or entry.get("kernel") not in names:
        return None
    seconds = entry["seconds"]
    if set(names) - set(seconds):
        return None
    try:
        picked = {n: float(seconds[n]) for n in names}
    except (TypeError, ValueError):
        return None
    return picked if all(math.isfinite(s) and s > 0 for s in picked.values()) else None


def _lacking(entry, names: list[str]) -> list[str]:
    """The candidates `names` an otherwise well-formed entry holds no time for."""
    if not isinstance(entry, dict) or not isinstance(entry.get("seconds"), dict):
        return []
    return [n for n in names if n not in entry["seconds"]]


_read_rate: float | None = None


def machine_read_rate(monitor: Monitor) -> float | None:
    """This machine's read rate in GB/s: from the cache, else measured (and cached if the machine
    was quiet); once per process."""
    global _read_rate
    if _read_rate is None:
        key = f"{compiled.cpu_model()}|read rate|{torch.get_num_threads()} threads"
        cached = cache.read().get(key)
        if isinstance(cached, (int, float)) and cached > 0:
            _read_rate = float(cached)
        else:
            rate, verdict = read_rate_gbps(monitor)
            if not verdict.disturbed:
                cache.write({key: rate})
            _read_rate = rate
    return _read_rate


def _read_rate_for(kind: Kind, monitor: Monitor):
    """What implausible() asks for the machine's read rate: only a streaming kind compares with
    it, and only when a weight is big enough to be judged (so a tiny model never measures it)."""
    return (lambda: machine_read_rate(monitor)) if kind.streams else None


def choose(kind: Kind, weights: list, rows: int = 1, env=os.environ, monitor: Monitor | None = None, orders: dict | None = None) -> Choice:
    """The kernel of `kind` for each key among `weights` (the model's projection weights of one
    format, in step order), for passes of `rows` rows (few-row kinds). orders: per key, the row
    order of the one-row kernel a batch-invariant few-row choice must sum like (where any
    candidate does)."""
    fmt = weight_format(weights[0]) if weights else ""
    keys = list(dict.fromkeys(key_of(kind, w) for w in weights))
    label = probe_label(max(weights, key=lambda t: t.shape[1])) if weights and kind.probe != "stream" else ""
    forced = kind.forced(env)
    if forced is not None:
        # The CLI refused a kernel that cannot run before any rank started (check_forced); an
        # engine made in-process is told here, and the check builds a compiled kernel's library.
        why = kind.by_name[forced].unavailable(fmt, weight_device(weights[0])) if weights else ""
        if why:
            raise UsageError(f"{kind.forcing(forced)}: {why}")
        return Choice(kind, fmt, "forced", dict.fromkeys(keys, forced), rows=rows, probe=label)
    if not weights:
        return Choice(kind, fmt, "default", rows=rows)
    device = weight_device(weights[0])
    names = kind.timed(fmt, device)
    # Every candidate the kind times is measured (the cache holds them all, whatever the run allows);
    # the choice is made among those this run allows.
    allowed = kind.allowed(fmt, device, batch_invariant(env))

    def allowed_for(key) -> list[str]:
        like = [n for n in allowed if orders is None or kind.by_name[n].row_order == orders.get(key)]
        return like or allowed

    if len(allowed) <= 1 or device.type != "cpu":
        return Choice(kind, fmt, "default", dict.fromkeys(keys, allowed[0] if allowed else kind.default), rows=rows, probe=label)
    monitor = monitor or Monitor()
    ckeys = {k: cache_key(kind, fmt, k, rows, label) for k in keys}
    nbytes = _bytes_per_key(kind, weights)
    stored = cache.read()
    cached = {k: _valid(stored.get(ck), names) for k, ck in ckeys.items()}
    reason = ""
    if all(cached.values()):
        bad = implausible(cached, nbytes, _read_rate_for(kind, monitor)) if kind.probe == "stream" else {}
        if bad:
            reason = f"re-measured: cached {_name(next(iter(bad)))} implausible ({next(iter(bad.values()))})"
        else:
            mine = {k: {n: s[n] for n in allowed_for(k)} for k, s in cached.items()}
            by_key = {k: pick(kind, s) for k, s in mine.items()}
            verdict, disagree = recheck(kind, weights, rows, mine, by_key, monitor)
            if verdict is not None and verdict.disturbed:
                return Choice(kind, fmt, "cached, check skipped: machine busy", by_key, cached, rows, verdict.describe(), label)
            if not disagree:
                return Choice(kind, fmt, "cached", by_key, cached, rows, probe=label)
            key, why = next(iter(disagree.items()))
            reason = f"re-measured: cached {_name(key)} disagreed ({why})"
    elif any(ck in stored for ck in ckeys.values()):
        # An entry written before a candidate could run here (a kernel added, or one whose
        # unavailability has gone) is whole but short of it: say which, not that it is broken.
        # Where every stored entry is sound, others are only absent (shapes no earlier run had).
        lacking = sorted({n for ck in ckeys.values() for n in _lacking(stored.get(ck), names)})
        absent = [k for k, ck in ckeys.items() if ck not in stored]
        if lacking:
            reason = f"re-measured: cached entry lacks {', '.join(lacking)}"
        elif any(not cached[k] for k in keys if k not in absent):
            reason = "re-measured: cached entry unreadable"
        else:
            reason = f"re-measured: {len(absent)} of {len(keys)} shapes not cached ({_name(absent[0])}{', ...' if len(absent) > 1 else ''})"
    seconds, verdict, bad = measure_trusted(kind, weights, rows, names, nbytes, monitor)
    by_key = {k: pick(kind, {n: seconds[k][n] for n in allowed_for(k)}) for k in keys}
    if verdict.disturbed or bad:
        # What the cache holds stays: the next load checks it again, on a quieter machine.
        how = NOT_CACHED_BUSY if verdict.disturbed else NOT_CACHED_IMPLAUSIBLE
        note = verdict.describe() if verdict.disturbed else f"{_name(next(iter(bad)))}: {next(iter(bad.values()))}"
        note = f"{reason}; {note}" if reason else note
        return Choice(kind, fmt, how, by_key, seconds, rows, note, label)
    entries = {ckeys[k]: {"kernel": by_key[k], "seconds": seconds[k], "bytes": nbytes[k], "others": round(verdict.others, 4)} for k in keys}
    cache.write(entries)
    return Choice(kind, fmt, reason or "measured", by_key, seconds, rows, probe=label)


def _name(key) -> str:
    return f"{key[0]}x{key[1]}" if isinstance(key, tuple) else str(key)


def _bytes_per_key(kind: Kind, weights: list) -> dict:
    if kind.probe == "stream":
        return {key_of(kind, w): weight_bytes(w) for w in weights}
    return {"probe": 0}


def measure_trusted(kind: Kind, weights: list, rows: int, names: list[str], nbytes: dict, monitor: Monitor) -> tuple[dict, Verdict, dict]:
    """Every candidate's seconds on every key, measured until the machine was quiet and the result
    plausible (at most ATTEMPTS times), with the last verdict and what was implausible. If no
    attempt could be trusted, each time is its fastest over all attempts (load only adds time)."""
    calls = calls_for(kind, weights, rows)
    slots = {c.key: names for c in calls}
    read_rate = _read_rate_for(kind, monitor)
    merged: dict = {}
    begun = time.perf_counter()
    for attempt in range(ATTEMPTS):
        if attempt > 1 and time.perf_counter() - begun > RETRY_BUDGET_S:
            break
        if attempt:
            time.sleep(RETRY_WAIT_S * attempt)
        started = monitor.start()
        seconds = time_calls(kind, calls, slots, PASSES, min_seconds=MIN_SECONDS, max_passes=MAX_PASSES)
        verdict = monitor.stop(started)
        bad = implausible(seconds, nbytes, read_rate) if kind.probe == "stream" else {}
        if not verdict.disturbed and not bad:
            return seconds, verdict, {}
        for k, by in seconds.items():
            into = merged.setdefault(k, {})
            for n, s in by.items():
                into[n] = min(into.get(n, float("inf")), s)
    return merged, verdict, bad


def recheck(kind: Kind, weights: list, rows: int, cached: dict, by_key: dict, monitor: Monitor) -> tuple[Verdict | None, dict]:
    """The cached kernel of every key against its runner-up, a few passes: the verdict on the
    machine meanwhile (None: nothing to check) and the keys where the timing disagrees with the
    cache, with why."""
    slots, judged = {}, []
    for k, seconds in cached.items():
        chosen = by_key[k]
        others = {n: s for n, s in seconds.items() if n != chosen}
        runner = min(others, key=others.get) if others else chosen
        slots[k] = [chosen, runner]
        if runner != chosen:
            judged.append(k)
    if not judged:
        return None, {}
    calls = calls_for(kind, weights, rows)
    started = monitor.start()
    stream = kind.probe == "stream"
    now = time_calls(kind, calls, slots, CHECK_PASSES if stream else 2, warm=False, min_seconds=CHECK_MIN_SECONDS, max_passes=CHECK_MAX_PASSES if stream else 2)
    verdict = monitor.stop(started)
    if verdict.disturbed:
        return verdict, {}
    disagree = {}
    for k in judged:
        chosen, runner = slots[k]
        c, r = now[k][chosen], now[k][runner]
        if max(c, r) < CHECK_MIN_CALL_S:
            continue
        if r * (1 + WASH + CHECK_NOISE) < c:
            disagree[k] = f"{runner} ran {c / r:.2f}x faster than {chosen}"
        elif max(c, cached[k][chosen]) > CHECK_RATIO * min(c, cached[k][chosen]):
            disagree[k] = f"{chosen} ran {c * 1e6:.0f} us a call against {cached[k][chosen] * 1e6:.0f} cached"
    return verdict, disagree

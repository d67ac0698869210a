"""The slice policy calibrated by measurement, and the calibration file it is built from.

`pocketllm calibrate` times the real overlapped projection at rows x slices points on this machine
and writes them here; the policy then picks, per row count, the fewest slices within 2% of the
fastest. The seed's rule was fitted by hand on one machine (4 x 910A); the crossover moves with
the collective's fixed term, which differs by orders of magnitude between backends.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass

from pocketllm.device import BACKENDS, resolve_kind
from pocketllm.distributed.policy import DEFAULT_COMM_OVERLAP_SLICES, PolicyChoice, SlicePolicy
from pocketllm.errors import UsageError

# A point within this fraction of the fastest is a wash, and a wash keeps fewer slices (the seed
# chose 1 slice at 1024 rows, where 1 and 2 were 0.1% apart).
WASH = 0.02
# What a calibration must match to describe this run; each is (file key, what to call it).
MATCHED = (("backend", "backend"), ("world", "TP world size"), ("hidden", "hidden size"), ("dtype", "dtype"))


@dataclass(frozen=True)
class Point:
    rows: int
    slices: int
    seconds: float
    # Each repetition's time; seconds is their median.
    reps: tuple[float, ...] = ()


@dataclass
class Calibration:
    backend: str
    device: str
    world: int
    hidden: int
    dtype: str
    created: str
    points: list[Point]
    allreduce_fit: dict | None = None

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "device": self.device,
            "world": self.world,
            "hidden": self.hidden,
            "dtype": self.dtype,
            "created": self.created,
            "points": [_point_json(p) for p in self.points],
            "allreduce_fit": self.allreduce_fit,
        }

    def describe(self) -> str:
        return f"{self.backend}, TP={self.world}, hidden {self.hidden}, {self.dtype}, {self.device}, created {self.created}"


def _point_json(p: Point) -> dict:
    out = {"rows": p.rows, "slices": p.slices, "seconds": p.seconds}
    if p.reps:
        out["reps"] = list(p.reps)
    return out


def _bad(path: str, what: str) -> UsageError:
    return UsageError(f"calibration {path}: {what}; make one with `pocketllm calibrate --out FILE`")


def _field(obj: dict, key: str, kind, path: str, where: str = ""):
    if key not in obj:
        raise _bad(path, f"missing {where}{key!r}")
    value = obj[key]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise _bad(path, f"{where}{key!r} is {value!r}, expected {getattr(kind, '__name__', 'a number')}")
    return value


def parse_calibration(data, path: str) -> Calibration:
    """A Calibration from decoded JSON, every field checked; any flaw is one UsageError line."""
    if not isinstance(data, dict):
        raise _bad(path, "not a JSON object")
    head = {k: _field(data, k, str, path) for k in ("backend", "device", "dtype", "created")}
    world = _field(data, "world", int, path)
    hidden = _field(data, "hidden", int, path)
    if world < 1 or hidden < 1:
        raise _bad(path, f"world {world} and hidden {hidden} must be positive")
    raw = data.get("points")
    if not isinstance(raw, list) or not raw:
        raise _bad(path, "no points (expected a non-empty list of {rows, slices, seconds})")
    points, seen = [], set()
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise _bad(path, f"points[{i}] is not an object")
        rows = _field(p, "rows", int, path, f"points[{i}].")
        slices = _field(p, "slices", int, path, f"points[{i}].")
        seconds = _field(p, "seconds", (int, float), path, f"points[{i}].")
        if rows < 1 or slices < 1 or not (seconds > 0 and math.isfinite(seconds)):
            raise _bad(path, f"points[{i}] has rows {rows}, slices {slices}, seconds {seconds}; all must be positive")
        if (rows, slices) in seen:
            raise _bad(path, f"points[{i}] repeats rows {rows} slices {slices}")
        seen.add((rows, slices))
        reps = p.get("reps", [])
        if not isinstance(reps, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in reps):
            raise _bad(path, f"points[{i}].'reps' is {reps!r}, expected a list of seconds")
        points.append(Point(rows, slices, float(seconds), tuple(float(t) for t in reps)))
    fit = data.get("allreduce_fit")
    if fit is not None and not isinstance(fit, dict):
        raise _bad(path, "allreduce_fit is not an object")
    return Calibration(head["backend"], head["device"], world, hidden, head["dtype"], head["created"], points, fit)


def load_calibration(path: str) -> Calibration:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise UsageError(f"calibration {path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(path, f"not valid JSON ({exc})") from None
    return parse_calibration(data, path)


def mismatches(cal: Calibration, backend: str, world: int, hidden: int, dtype: str) -> list[str]:
    """Where the calibration describes a different run than this one, e.g. 'TP world size 4 (this run 2)'."""
    here = {"backend": backend, "world": world, "hidden": hidden, "dtype": dtype}
    return [f"{name} {getattr(cal, key)} (this run {here[key]})" for key, name in MATCHED if getattr(cal, key) != here[key]]


def check_calibration(cal: Calibration, path: str, backend: str, world: int, hidden: int, dtype: str, force: bool) -> str | None:
    """Refuse a calibration made for another run; with force, return the note the run prints instead."""
    wrong = mismatches(cal, backend, world, hidden, dtype)
    if not wrong:
        return None
    listed = ", ".join(wrong)
    if not force:
        raise UsageError(f"calibration {path} was made for {listed}; recalibrate, or pass --force-calibration to use it anyway")
    return f"using calibration {path} made for {listed} (--force-calibration)"


def choose_slices(points: list[Point], ceiling: int) -> dict[int, int]:
    """Per calibrated row count, the fewest slices within WASH of the fastest, counting only
    slice counts at or below the ceiling; 1 where none is."""
    by_rows: dict[int, list[Point]] = {}
    for p in points:
        by_rows.setdefault(p.rows, []).append(p)
    choice = {}
    for rows, pts in sorted(by_rows.items()):
        allowed = [p for p in pts if p.slices <= max(1, ceiling)]
        if not allowed:
            choice[rows] = 1
            continue
        fastest = min(p.seconds for p in allowed)
        choice[rows] = min(p.slices for p in allowed if p.seconds <= fastest * (1 + WASH))
    return choice


class CalibratedPolicy(SlicePolicy):
    """Between calibrated row counts, the choice of the nearest calibrated count below; above the
    largest, the largest's; below the smallest, 1 (serial, as the rule gives short passes)."""

    def __init__(self, calibration: Calibration, ceiling: int = DEFAULT_COMM_OVERLAP_SLICES, source: str = ""):
        self.calibration = calibration
        self.ceiling = ceiling
        self.source = source
        self.choices = choose_slices(calibration.points, ceiling)
        self._rows = sorted(self.choices)

    def slices_for_rows(self, rows: int) -> int:
        # choose_slices already holds a ceiling <= 1 to one slice everywhere.
        i = bisect.bisect_right(self._rows, rows) - 1
        if i < 0:
            return 1
        return self.choices[self._rows[i]]

    def describe(self) -> str:
        picks = ", ".join(f"{r}->{s}" for r, s in self.choices.items())
        return f"calibrated (ceiling {self.ceiling}; {picks})"


def checked_for_run(choice: PolicyChoice, args, hidden: int) -> PolicyChoice:
    """The plan's policy, with a calibrated one checked against the run it would drive: the
    backend --device resolves to, --tp-world, the model's hidden size and --dtype."""
    policy = choice.policy
    if not isinstance(policy, CalibratedPolicy):
        return choice
    backend = BACKENDS[resolve_kind(args.device)]
    force = bool(getattr(args, "force_calibration", False))
    note = check_calibration(policy.calibration, policy.source, backend, args.tp_world, hidden, args.dtype, force)
    return PolicyChoice(policy, "; ".join(n for n in (choice.note, note) if n) or None)

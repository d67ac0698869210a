"""The calibration file: what `pocketllm calibrate` measured, read back and checked.

`pocketllm calibrate` times the real overlapped projection at rows x slices points on this machine
and writes them here; the calibrated slice policy (distributed/policy.py) is built from them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pocketllm.errors import UsageError

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
    collective: str | None = None  # the all-reduce it was measured on (shm, gloo, ...); None in older files

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
            **({"collective": self.collective} if self.collective is not None else {}),
        }

    def describe(self) -> str:
        over = f" ({self.collective} all-reduce)" if self.collective not in (None, self.backend) else ""
        return f"{self.backend}{over}, TP={self.world}, hidden {self.hidden}, {self.dtype}, {self.device}, created {self.created}"


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
    collective = data.get("collective")
    if collective is not None and not isinstance(collective, str):
        raise _bad(path, f"'collective' is {collective!r}, expected str")
    return Calibration(head["backend"], head["device"], world, hidden, head["dtype"], head["created"], points, fit, collective)


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


def check_collective(cal: Calibration, path: str, collective: str | None, force: bool) -> str | None:
    """The all-reduce a run's ranks set up (known only once they have) against the one the
    calibration was measured on: slicing pays on one and not the other (docs/collectives.md).
    Refused as check_calibration refuses; with force, the note the run prints instead."""
    if cal.collective is None or collective is None or cal.collective == collective:
        return None
    return _made_for(path, f"the {cal.collective} all-reduce (this run {collective})", force, f", pass --collective {cal.collective}")


def check_calibration(cal: Calibration, path: str, backend: str, world: int, hidden: int, dtype: str, force: bool) -> str | None:
    """Refuse a calibration made for another run; with force, return the note the run prints instead."""
    wrong = mismatches(cal, backend, world, hidden, dtype)
    return _made_for(path, ", ".join(wrong), force) if wrong else None


def _made_for(path: str, what: str, force: bool, remedy: str = "") -> str:
    """A calibration made for `what` refused (UsageError), or with force the note the run prints."""
    if not force:
        raise UsageError(f"calibration {path} was made for {what}; recalibrate{remedy}, or pass --force-calibration to use it anyway")
    return f"using calibration {path} made for {what} (--force-calibration)"

"""How many slices the overlapped projection uses for a given row count.

The seed's rule (section 4): double the slice count while each slice keeps at least
K_MIN_ROWS_PER_OVERLAP_SLICE rows, up to the ceiling `comm_overlap_slices`. A pin uses one count
everywhere, for sweeps. Decode rows (the batch) always come out serial under the rule. The
calibrated policy replaces the rule with measurements of this machine (the points of a
calibration file, distributed/calibration.py): per row count, the fewest slices within 2% of the
fastest. The seed's rule was fitted by hand on one machine (4 x 910A); the crossover moves with
the collective's fixed term, which differs by orders of magnitude between backends.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from pocketllm.distributed.calibration import Calibration, Point, check_collective, load_calibration
from pocketllm.errors import UsageError
from pocketllm.switches import env_setting, env_value

K_MIN_ROWS_PER_OVERLAP_SLICE = 1024
DEFAULT_COMM_OVERLAP_SLICES = 4
# The ceiling is also read as the seed's QWEN_COMM_OVERLAP_SLICES (pocketllm.switches.ALIASES).
ENV_CEILING = "POCKETLLM_COMM_OVERLAP_SLICES"
ENV_PIN = "POCKETLLM_PIN_SLICES"
ENV_CALIBRATION = "POCKETLLM_CALIBRATION"
OVERLAP_POLICIES = ("rule", "calibrated")
# A point within this fraction of the fastest is a wash, and a wash keeps fewer slices, as the
# seed did: a gain inside the noise buys nothing for the extra collectives (docs/collectives.md,
# the calibrated policy).
WASH = 0.02


def comm_overlap_slices_for_rows(rows: int, ceiling: int = DEFAULT_COMM_OVERLAP_SLICES) -> int:
    slices = 1
    if ceiling <= 1:
        return slices
    while rows / (2 * slices) >= K_MIN_ROWS_PER_OVERLAP_SLICE and 2 * slices <= ceiling:
        slices *= 2
    return slices


class SlicePolicy:
    def slices_for_rows(self, rows: int) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        """One line naming the policy and its settings, for the run's report."""
        raise NotImplementedError


@dataclass
class RulePolicy(SlicePolicy):
    ceiling: int = DEFAULT_COMM_OVERLAP_SLICES

    def slices_for_rows(self, rows: int) -> int:
        return comm_overlap_slices_for_rows(rows, self.ceiling)

    def describe(self) -> str:
        return f"rule (ceiling {self.ceiling})"


@dataclass
class PinnedPolicy(SlicePolicy):
    slices: int

    def slices_for_rows(self, rows: int) -> int:
        # Fewer rows than slices run serial (a slice of no rows has nothing to overlap), as does a
        # pin of 0: said as 1, so `policy` and a pass's report give what runs.
        return self.slices if rows >= self.slices > 0 else 1

    def describe(self) -> str:
        return f"pinned at {self.slices}"


def parse_knob(value: str | int | None, what: str) -> int | None:
    """A non-negative integer knob from a flag or an env var; None when unset."""
    if value is None or value == "":
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        raise UsageError(f"{what} must be a non-negative integer, got {value!r}") from None
    if number < 0:
        raise UsageError(f"{what} must be a non-negative integer, got {number}")
    return number


@dataclass
class PolicyChoice:
    policy: SlicePolicy
    # One line the run prints once (on rank 0) when it overrode a knob, else None.
    note: str | None = None


def _given_ceiling(ceiling: str | int | None, env) -> int | None:
    value = parse_knob(ceiling, "--comm-overlap-slices")
    if value is not None:
        return value
    used, raw = env_setting(env, ENV_CEILING)
    return parse_knob(raw, used)


def resolve_ceiling(ceiling: str | int | None = None, env=os.environ) -> int:
    """The rule's ceiling alone (flag, else env, else the default), for commands that build their
    own policies from it and so must not be stopped by a pin or a calibration in the environment."""
    value = _given_ceiling(ceiling, env)
    return DEFAULT_COMM_OVERLAP_SLICES if value is None else value


def resolve_policy(
    pin: str | int | None = None,
    ceiling: str | int | None = None,
    env=os.environ,
    overlap_policy: str | None = None,
    calibration: str | None = None,
) -> PolicyChoice:
    """Flags win over env vars; a pin wins over a ceiling and the run says so once. A calibration
    file (--calibration or ENV_CALIBRATION) selects the calibrated policy unless --overlap-policy
    rule asks for the rule; without one the rule is the default."""
    pin_value = parse_knob(pin, "--pin-slices")
    if pin_value is None:
        pin_value = parse_knob(env_value(env, ENV_PIN), ENV_PIN)
    ceiling_value = _given_ceiling(ceiling, env)
    calibration_path = calibration or env_value(env, ENV_CALIBRATION) or None
    if overlap_policy not in (None, *OVERLAP_POLICIES):
        raise UsageError(f"--overlap-policy {overlap_policy!r} is not one of {', '.join(OVERLAP_POLICIES)}")
    if overlap_policy == "calibrated" and calibration_path is None:
        raise UsageError(f"--overlap-policy calibrated needs --calibration FILE (or env {ENV_CALIBRATION})")
    calibrated = calibration_path is not None and overlap_policy != "rule"
    if pin_value is not None:
        note = None
        if calibrated:
            note = f"slice pin {pin_value} overrides the calibrated policy from {calibration_path}"
        elif ceiling_value is not None:
            note = f"slice pin {pin_value} overrides the rule's ceiling {ceiling_value}"
        return PolicyChoice(PinnedPolicy(pin_value), note)
    if ceiling_value is None:
        ceiling_value = DEFAULT_COMM_OVERLAP_SLICES
    if calibrated:
        return PolicyChoice(CalibratedPolicy(load_calibration(calibration_path), ceiling_value, calibration_path))
    return PolicyChoice(RulePolicy(ceiling_value))


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


def collective_note(policy: SlicePolicy, collective: str | None, force: bool) -> str | None:
    """A calibrated policy's all-reduce checked against the one the ranks set up
    (calibration.check_collective); None for any other policy."""
    if not isinstance(policy, CalibratedPolicy):
        return None
    return check_collective(policy.calibration, policy.source, collective, force)

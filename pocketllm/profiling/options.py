"""Which profiles a run asked for, from flags or environment variables: resolved and checked once,
before any rank starts, and carried to the ranks in the run plan (pocketllm/run_plan.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pocketllm.errors import UsageError
from pocketllm.switches import env_switch

ENV_PHASE = "POCKETLLM_PHASE_PROFILE"
ENV_HOST = "POCKETLLM_HOST_PROFILE"


@dataclass(frozen=True)
class ProfileOptions:
    phase: bool = False
    host: bool = False
    profile_out: str | None = None  # directory for the JSON-lines blocks, one file per rank
    trace_out: str | None = None  # directory for the Chrome traces, one file per rank
    # Print the phase (host) blocks to stderr at the end of the run; each is its own switch, so a
    # command that turns one off leaves the other as asked.
    phase_text: bool = True
    host_text: bool = True
    split_skew: bool = False  # phase profile: a barrier before each all-reduce, timed as tp_skew

    @property
    def enabled(self) -> bool:
        return self.phase or self.host


def _check_out_dir(flag: str, path: str) -> None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create the directory ({exc.strerror})") from None


def phase_requested(flag: bool, env=os.environ) -> bool:
    """Whether the run asked for the phase profile, by --phase-profile or env var."""
    return bool(flag) or env_switch(env, ENV_PHASE)


def profile_options(
    phase_profile: bool = False,
    host_profile: bool = False,
    profile_out: str | None = None,
    trace_out: str | None = None,
    split_skew: bool = False,
    phase_text: bool = True,
    env=os.environ,
) -> ProfileOptions:
    """The profiles a run asked for, from the flags or env vars. `phase_text` False (only
    `profile`, which always profiles, and prints its tables instead) keeps the phase blocks off
    stderr; everywhere else they print."""
    phase = phase_requested(phase_profile, env)
    host = bool(host_profile) or env_switch(env, ENV_HOST)
    # A trace is of host spans: asking for one turns the host profile on.
    host = host or trace_out is not None
    if split_skew and not phase:
        raise UsageError("--split-skew splits the phase profile's all-reduce time: add --phase-profile (or POCKETLLM_PHASE_PROFILE=1)")
    if profile_out is not None and not (phase or host):
        raise UsageError("--profile-out needs a profile: add --phase-profile or --host-profile (or POCKETLLM_PHASE_PROFILE=1 or POCKETLLM_HOST_PROFILE=1)")
    if profile_out is not None:
        _check_out_dir("--profile-out", profile_out)
    if trace_out is not None:
        _check_out_dir("--trace-out", trace_out)
    return ProfileOptions(phase, host, profile_out, trace_out, phase_text=phase_text, split_skew=bool(split_skew))

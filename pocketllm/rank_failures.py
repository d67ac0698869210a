"""How a failed run is put into one line: what a rank says when it fails, and which rank the
launcher names when several have.

A rank keeps track of where it is (the rendezvous, loading, a pass), so a collective that fails
can say where; it leaves the launcher a one-line report of how it failed (a JSON file in the run's
private directory), so the launcher's last line says why, not only that, a rank ended. When
several ranks have failed the launcher names the one least likely to have failed because of
another. (pocketllm/fault_injection.py is the other side: it makes ranks fail, for the tests.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

from pocketllm import stdout_gone
from pocketllm.switches import env_value

ENV_REPORT = "POCKETLLM_LAUNCH_REPORT"
# When two failures are seen at once, the one least likely to follow from another comes first:
# a death by signal or an exit without a report (nothing a peer does causes those), then an
# exception or a user error (any other kind: 1), then a timed-out collective, then a lost peer.
_CONSEQUENCE = {"timeout": 2, "peer": 3}
# The report of a rank whose stdout lost its reader (pocketllm/stdout_gone.py): no failure to name.
STDOUT_GONE = "stdout-gone"
# The report of a failure the rank words whole (serve's HTTP process gone): the launcher's line is
# the one the same command prints without a launcher, whatever the world size.
OWN_LINE = "own-line"

# Where this rank is, for the line a failed collective leaves.
_where = {"place": "starting", "timeout_s": None}


def set_place(place) -> None:
    """Where this rank is now: words, or an object put into words only if a collective fails."""
    _where["place"] = place


def set_timeout(timeout_s: float) -> None:
    _where["timeout_s"] = timeout_s


def timeout() -> float | None:
    return _where["timeout_s"]


class _PassPlace:
    """A pass as a place, put into words only if a collective fails in it."""

    __slots__ = ("info", "after")

    def __init__(self, info, after: bool):
        self.info, self.after = info, after

    def __str__(self) -> str:
        return f"{'after ' if self.after else ''}{self.info.kind} pass {self.info.index}"


class PassTracker:
    """A pass hook that remembers where this rank is, so a failed collective can say where. It
    runs around every decode step, so it only keeps the pass; the words are made on failure."""

    # It records where the run is and watches no layer: a decode row may go straight to the step.
    watches_layers = False

    def before_pass(self, info) -> None:
        _where["place"] = _PassPlace(info, after=False)

    def after_pass(self, info) -> None:
        _where["place"] = _PassPlace(info, after=True)


def collective_failure(exc: BaseException) -> str | None:
    """"timeout" or "peer" when exc is a collective that timed out or lost a peer, else None. By
    type where torch says it (a network error is a lost peer); gloo raises a plain RuntimeError
    for both (torch 2.13: "Timed out waiting 2000ms for recv operation", "Connection closed by
    peer"), so there only the message tells them apart. On NCCL/HCCL a timed-out collective
    raises nothing: the backend's watchdog aborts the process (describe_exit says so)."""
    # The shared-memory all-reduce says which it was.
    kind = getattr(exc, "collective_kind", None)
    if kind is not None:
        return kind
    # Imported here, not at the top: the launcher reads this module and never imports torch.
    import torch.distributed as dist

    if isinstance(exc, dist.DistNetworkError):
        return "peer"
    text = str(exc).lower()
    if not (isinstance(exc, dist.DistError) or any(b in text for b in ("gloo", "nccl", "hccl", "store"))):
        return None
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(m in text for m in ("closed by peer", "reset by peer", "broken pipe", "connection refused", "econnreset")):
        return "peer"
    return None


def out_of_memory(exc: BaseException) -> str | None:
    """What a rank says about an allocation its device or its host refused (torch's
    OutOfMemoryError on CUDA, the message torch_npu's says; the CPU allocator's refusal), or None
    for any other exception. torch's own sentences on where the memory went are kept as far as
    what was free; its advice on allocator settings is left out."""
    text = " ".join(str(exc).split())
    if type(exc).__name__ == "OutOfMemoryError" or re.match(r"\w+ out of memory", text):
        said = ". ".join(text.split(". ")[:3]).rstrip(".")
    elif found := re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", text):
        said = f"the host refused {int(found.group(1)) / 2**30:.2f} GiB"
    else:
        return None
    return (f"out of memory ({said}): the weights, the KV cache and the working memory do not fit; more ranks (--tp-world), "
            f"fewer sequences at once or shorter ones take less")


def collective_line(kind: str) -> str:
    """What this rank says about a collective that failed (collective_failure's kind) where it is."""
    place, timeout_s = _where["place"], _where["timeout_s"]
    # Set by every rank that joins a group; a process that joined none has no bound to name.
    after = f"after {timeout_s:g} s " if timeout_s is not None else ""
    if kind == "timeout" and str(place) == "the rendezvous":
        return f"the rendezvous timed out {after}(--dist-timeout): not every rank joined"
    if kind == "timeout":
        return (
            f"a collective it waited for in {place} timed out {after}(--dist-timeout): "
            f"another rank never joined it; it hung, died, or is slower than the timeout"
        )
    return f"lost its connection to another rank in {place}: that rank died or exited"


def leave_report(kind: str, line: str) -> None:
    """Leave the launcher this rank's failure (nothing when no launcher started the rank)."""
    path = env_value(os.environ, ENV_REPORT)
    if not path:
        return
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"kind": kind, "line": line, "time": time.time()}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def fail_with(line: str) -> int:
    """End this rank's command with `line` as the run's last line: left for the launcher, or
    printed where none started the rank. Returns the exit status (1)."""
    if env_value(os.environ, ENV_REPORT):
        leave_report(OWN_LINE, line)
    else:
        print(f"pocketllm: error: {line}", file=sys.stderr, flush=True)
    return 1


def report_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.report")


def read_report(run_dir: str, rank: int) -> dict | None:
    try:
        with open(report_path(run_dir, rank)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def first_failure(codes: list[int | None], failed: list[int], reports: dict[int, dict | None]) -> int:
    """The rank whose failure caused the others', from every rank's exit code so far (None while
    running) and report. A rank that lost a peer or timed out may exit before the rank that raised
    and broke the group; the raiser has left its report by then, so it is the one named."""
    suspects = set(failed) | {r for r, rep in reports.items() if rep and _consequence(None, rep) <= 1}
    # Ties go to the earlier report: the ranks share one clock.
    return min(suspects, key=lambda r: (_consequence(codes[r], reports[r]), (reports[r] or {}).get("time", 0.0), r))


def _consequence(code: int | None, report: dict | None) -> int:
    """0 for a failure surely of its own, higher the likelier it follows from another rank's."""
    if (code is not None and code < 0) or report is None:
        return 0
    return _CONSEQUENCE.get(report["kind"], 1)


def failed_rank_line(rank: int, code: int | None, report: dict | None, stopped: bool, backend: str = "gloo") -> tuple[str, int]:
    """The launcher's last line for a run that rank `rank` ended ("" for none), and the launcher's
    exit status. `stopped`: the rank was still running when the others were stopped, so its exit
    status is the launcher's signal, not its own failure. `backend`: the run's collectives'."""
    if report and report["kind"] == "usage":
        return f"pocketllm: error: {report['line']}", 2
    if report and report["kind"] == OWN_LINE:
        return f"pocketllm: error: {report['line']}", 1
    if report and report["kind"] == STDOUT_GONE:
        # Nothing to say to a reader that left, as a single process would say nothing.
        return "", stdout_gone.EXIT_STATUS
    # A rank stopped by the launcher still exiting: its report says why, the signal would not.
    how = "" if stopped and report else f" ({describe_exit(code, backend)})"
    detail = f": {report['line']}" if report else ""
    return f"pocketllm: error: rank {rank} failed{how}{detail}", 1


def describe_exit(code: int, backend: str = "gloo") -> str:
    if code == -signal.SIGABRT and backend in ("nccl", "hccl"):
        # NCCL's (and HCCL's) watchdog aborts a rank whose collective timed out or failed.
        return "killed by signal SIGABRT: on NCCL/HCCL, the watchdog's abort after a collective timed out or failed"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"

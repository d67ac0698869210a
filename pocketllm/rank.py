"""What one rank does around a command's work: find its place in the run, join the process group,
take rank 0's checked inputs, and end with one line if anything fails (pocketllm/rank_failures.py words
it). The ranks are started by pocketllm's launcher (pocketllm/launch.py), by torchrun, or by hand,
one process per rank, meeting at `--rendezvous-file FILE`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

import torch.distributed as dist

from pocketllm import rank_failures
from pocketllm.distributed import collective, rendezvous, waiting
from pocketllm.distributed.state import set_tp
from pocketllm.errors import UsageError
from pocketllm.interrupts import sigterm_interrupts
from pocketllm.launch import launcher_checked
from pocketllm.place import RankEnv
from pocketllm.stdout_gone import EXIT_STATUS as STDOUT_EXIT
from pocketllm.stdout_gone import quiet_stdout, stdout_gone


def join_group(renv: RankEnv, backend: str, timeout_s: float) -> None:
    set_tp(renv.rank, renv.world)
    rank_failures.set_timeout(timeout_s)
    # Set for every run, a world of one included (which waits on no collective, so polls none):
    # a process that ran ranks of a larger world before must not report their setting.
    waiting.configure(backend if renv.world > 1 else None)
    if renv.world == 1:
        return
    rank_failures.set_place("the rendezvous")
    rendezvous.join_group(backend, renv.rank, renv.world, timeout_s, renv.file_store, renv.id_path)
    rank_failures.set_place("loading")


def setup_collective(renv: RankEnv, choice: str, backend: str, asked: str = "") -> None:
    """Choose the engine's all-reduce (pocketllm.distributed.collective) once the group runs on
    checked inputs; its waits honour the same --dist-timeout as the group's."""
    if renv.world == 1:
        return
    rank_failures.set_place("setting up the all-reduce")
    collective.setup(choice, backend, renv.rank, renv.world, rank_failures.timeout(), asked)
    rank_failures.set_place("loading")


def leave_group(failed: bool = False) -> None:
    collective.close()
    rendezvous.leave_group(failed)


class RefusedByRank0(UsageError):
    """Rank 0 found the inputs bad and said so; this rank stops quietly with it."""


def checked_on_rank0(renv: RankEnv, check, join, env=os.environ):
    """Rank 0 runs check(), once, and every rank gets its result (or its one-line error) over the
    process group that join() sets up, so all ranks run on the same checked inputs or all stop.
    Under the launcher, which ran the same check before it started any rank, rank 0 shares the
    launcher's result instead of checking again. A hand-started rank 0 whose check fails stops at
    once, before the rendezvous, as a refused command does (the CLI tells the other ranks in its
    --rendezvous-file: rendezvous.tell_the_others): it waited there for them first, up to the
    bound (2 minutes), before it said what was wrong."""
    verdict = None
    if renv.rank == 0:
        launched, checked = launcher_checked(env) if renv.file_store is not None else (False, None)
        try:
            verdict = (True, checked if launched else check())
        except UsageError as exc:
            if renv.id_path is not None:
                raise
            verdict = (False, str(exc))
    try:
        join()
    except Exception:
        if verdict is not None and not verdict[0]:
            raise UsageError(verdict[1]) from None
        raise
    if renv.world > 1:
        rank_failures.set_place("sharing rank 0's checked inputs")
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
        rank_failures.set_place("loading")
    ok, value = verdict
    if not ok:
        raise (UsageError if renv.rank == 0 else RefusedByRank0)(value)
    return value


# What a rank's own command line may set apart from rank 0's: its place and device, how long it
# waits, the test-only fault, and where it writes (a file only rank 0 writes may be given to it alone).
_OWN = {"world.rank", "world.dist_timeout", "world.cpus", "world.collective_asked", "device.requested", "device.index", "fault"}
_OUTPUTS = {"json", "logits_out", "profile_out", "trace_out", "plot", "out", "stream"}


def same_settings(renv: RankEnv, plan_json: str) -> None:
    """Ranks started without the launcher (by hand, torchrun) each planned from their own command
    line, and rank 0's checked inputs (the model, the prompt) are what every rank uses; but a
    setting that steers the run's own steps (the command, --max-new-tokens, --collective, the
    slice policy) must be the same on every rank, or they part ways mid-run (a lost connection, a
    collective that waits out --dist-timeout). Every rank learns every rank's settings and stops
    with one line naming the first rank that differs, before any collective of the run."""
    if renv.world == 1 or renv.file_store is not None:
        return
    mine = {k: v for k, v in _flat(json.loads(plan_json)).items() if k not in _OWN and k.rsplit(".", 1)[-1] not in _OUTPUTS}
    every = [None] * renv.world
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every[1:], start=1):
        keys = sorted(k for k in set(theirs) | set(every[0]) if theirs.get(k) != every[0].get(k))
        if keys:
            said = "; ".join(f"{_flag(k)} {_shown(theirs.get(k))} on rank {rank}, {_shown(every[0].get(k))} on rank 0" for k in keys)
            raise UsageError(f"the ranks were started with different settings: {said} (every rank's command must be rank 0's "
                             "but for --tp-rank, --device, --dist-timeout and its output files)")


def _flat(doc: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


# Plan fields whose flag is not their name.
_FLAGS = {
    "command": "the command",
    "world.size": "--tp-world",
    "world.collective": "--collective (or POCKETLLM_COLLECTIVE)",
    "slices.ceiling": "--comm-overlap-slices",
    "slices.pin": "--pin-slices",
}


def _flag(key: str) -> str:
    """The command-line spelling of a plan field, as near as it has one."""
    return _FLAGS.get(key) or "--" + key.rsplit(".", 1)[-1].replace("_", "-")


def _shown(value) -> str:
    return "(not given)" if value is None else str(value)


def run_rank(renv: RankEnv, body) -> int:
    """Run this rank's part, then leave the process group. A failure becomes one line: written for
    the launcher when there is one, else printed. Collective failures end the rank with exit 1 and
    no traceback; other exceptions keep theirs (the launcher still names them). The line is
    written before the group is left: peers notice a rank leave at once, and the launcher must
    already know which rank failed first."""
    launched = rank_failures.ENV_REPORT in os.environ
    code = None
    try:
        # A rank started by hand is stopped as any process is, by SIGTERM too: it unwinds as at
        # Ctrl-C (one line, exit 130, rank 0's rendezvous file removed). A launcher's ranks keep
        # the default: the launcher stops them with it and names how each ended.
        with sigterm_interrupts() if renv.id_path is not None else contextlib.nullcontext():
            code = body()
            return code
    except RefusedByRank0 as exc:
        rank_failures.leave_report("usage", str(exc))
        return 2
    except UsageError as exc:
        if not launched:
            raise
        rank_failures.leave_report("usage", str(exc))
        return 2
    except BrokenPipeError as exc:
        # The output's reader went away (`| head`): the run ends quietly, every rank with it.
        if not (launched and stdout_gone(exc)):
            raise
        rank_failures.leave_report(rank_failures.STDOUT_GONE, "")
        quiet_stdout()
        return STDOUT_EXIT
    except Exception as exc:
        kind = rank_failures.collective_failure(exc)
        memory = None if kind is not None else rank_failures.out_of_memory(exc)
        if memory is not None:
            # One line, as the launcher's for any failed rank: a traceback adds nothing to it.
            return rank_failures.fail_with(f"rank {renv.rank}: {memory}")
        if kind is None:
            rank_failures.leave_report("exception", traceback.format_exception_only(exc)[-1].strip())
            raise
        line = rank_failures.collective_line(kind)
        rank_failures.leave_report(kind, line)
        if not launched:
            print(f"pocketllm: error: rank {renv.rank}: {line}", file=sys.stderr, flush=True)
        return 1
    finally:
        leave_group(failed=code != 0)

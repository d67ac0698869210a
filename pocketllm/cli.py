"""The `pocketllm` command line: one subcommand per task, every user error one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

from pocketllm import __version__, startup
from pocketllm.distributed import rendezvous
from pocketllm.errors import UsageError
from pocketllm.place import under_torchrun
from pocketllm.run_plan import RunPlan, received
from pocketllm.stdout_gone import EXIT_STATUS as STDOUT_GONE
from pocketllm.stdout_gone import guard_stdout, quiet_stdout, stdout_gone
from pocketllm.switches import check_switches, environment_notes

# name -> (module under pocketllm, help); each module's add_arguments adds the shared flag groups
# it uses (pocketllm.model_args) and its own. Only the module of the command that runs is
# imported: most import torch, which `pocketllm --help` and `pocketllm policy` do not need.
COMMANDS = {
    "generate": ("commands.generate", "generate tokens from a prompt"),
    "bench": ("commands.bench", "resident bench: timed prefill and decode"),
    # The seed's rank binary and its section 8 command line, as the bench runs it (docs/seed.md).
    "engine": ("commands.bench", "the seed's pocketllm_engine rank command: the resident bench (docs/seed.md)"),
    "make-checkpoint": ("commands.make_checkpoint", "write a preset as an HF safetensors checkpoint"),
    "quantize": ("commands.quantize", "write a checkpoint's weights int8/int4 quantized (compressed-tensors)"),
    "policy": ("commands.policy", "print the slice count per row count, starting no rank"),
    "profile": ("commands.profile", "where the prefill wall goes: phase-profile tables per prompt length"),
    "allreduce": ("commands.allreduce", "all-reduce cost per payload size, with a latency/bandwidth fit"),
    "calibrate": ("commands.calibrate", "time the overlapped projection per rows x slices and write a calibration"),
    "sweep": ("commands.sweep", "prefill/decode TPS per row count for pinned slice counts and policies"),
    "gdn-bench": ("commands.gdn_bench", "time the gated delta rule kernels side by side"),
    "serve": ("commands.serve", "an OpenAI-compatible HTTP server (needs the serve extra)"),
}


class _Refused(Exception):
    """A flag argparse refused, as `PROG: error: MESSAGE`."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # A flag's prefix is not taken for it: `bench --prompt 64` would run as --prompt-tokens 64,
        # and a flag added later would change what an old command line means.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise _Refused(f"{self.prog}: error: {message}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: every command listed, and the flags of the one argv names (the top
    level has no flag but --help and --version, so that is the first word not starting with '-')."""
    parser = _Parser(prog="pocketllm", description="Tensor-parallel inference and measurement for the Qwen3.5/Qwen3.8 hybrid decoder.")
    parser.add_argument("--version", action="version", version=f"pocketllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            with startup.importing():
                mod = importlib.import_module(f"pocketllm.{module}")
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rendezvous.begin_command()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        given = received(os.environ)
    except UsageError as exc:
        print(f"pocketllm: error: {exc}", file=sys.stderr)
        return 2
    if given is None:
        try:
            # Parsing imports the command's module, and so torch: a second or more of a core.
            args = build_parser(argv).parse_args(argv)
        except _Refused as exc:
            print(exc, file=sys.stderr)
            _tell_the_other_ranks(argv, str(exc).split(": error: ", 1)[1])
            return 2
        except KeyboardInterrupt:
            print("pocketllm: interrupted", file=sys.stderr)
            return 130
        starts = _starts_the_run(args, os.environ)
        if starts:
            for line in environment_notes(os.environ):
                print(line, file=sys.stderr, flush=True)
    try:
        if given is None and starts:
            check_switches(os.environ)
        if given is not None:
            # A rank the launcher started: it runs on the launcher's plan, not on a command line.
            command, text = given
            with startup.importing():
                mod = importlib.import_module(f"pocketllm.{COMMANDS[command][0]}")
            return int(mod.execute(RunPlan.from_json(text, mod.Task)) or 0)
        return int(args._module.run(args) or 0)
    except UsageError as exc:
        print(f"pocketllm: error: {exc}", file=sys.stderr)
        if given is None:
            _tell_the_other_ranks(argv, str(exc))
        return 2
    except KeyboardInterrupt:
        print("pocketllm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as exc:
        if not stdout_gone(exc):
            raise
        quiet_stdout()
        return STDOUT_GONE


def engine_main(argv: list[str] | None = None) -> int:
    """The seed's rank binary, `pocketllm engine ARGS` (the `pocketllm_engine` console script)."""
    return main(["engine", *(sys.argv[1:] if argv is None else argv)])


def exit_with(code: int) -> NoReturn:
    """End this process with exit status `code`, once a command has returned. Where torch is
    loaded, without the interpreter's teardown: tearing torch down takes about a quarter of a
    second of a core, which every rank paid at the end of every run, and pocketllm registers
    nothing to run at exit and leaves no thread to wait for (the process group is left, files
    closed, by the commands themselves). What the teardown would still have done is flushing:
    done here, a failed flush ending the process with 120 as the interpreter's own would. A
    process without torch (a launcher, --help, policy) exits as usual: its teardown is cheap."""
    if "torch" not in sys.modules:
        sys.exit(code)
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        code = 120
    os._exit(code)


def script() -> NoReturn:
    """The `pocketllm` console script (and `python -m pocketllm`)."""
    startup.owned()
    _open_standard_streams()
    exit_with(main())


def engine_script() -> NoReturn:
    """The `pocketllm_engine` console script."""
    startup.owned()
    _open_standard_streams()
    exit_with(engine_main())


def _open_standard_streams() -> None:
    """A process started with stdin, stdout or stderr closed (`>&-`, a daemon's start) gets
    /dev/null there, as the shell's `>/dev/null` would give it: Python leaves sys.stdout None
    (a write or flush of it was a traceback), and the next file this process or a rank it starts
    opened took the closed number (with stderr closed, the ranks' notes went into stdout, mixed
    with the results)."""
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, flags)  # the lowest free number: fd itself, lower ones being open
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))
    guard_stdout()


def _tell_the_other_ranks(argv: list[str], message: str) -> None:
    """A hand-started rank refused its command: the others, started with it, wait for it at
    --rendezvous-file (or the seed's --nccl-id-path) and would wait out their bound. Rank 0
    makes the file saying so (rendezvous.tell_the_others); another rank tells its rank 0 in its
    file (tell_rank0). Read from the command line as given, since argparse may have refused it.
    The line is printed first: this process may then wait a few seconds."""
    rank = _given(argv, "--tp-rank")
    path = _given(argv, "--rendezvous-file") or _given(argv, "--nccl-id-path")
    if path is None or rank is None or not rank.isdigit() or under_torchrun():
        return  # not a rank started by hand (under torchrun those flags are refused, and no one waits on them)
    sys.stderr.flush()
    if int(rank) == 0:
        world = _given(argv, "--tp-world")
        rendezvous.tell_the_others(path, int(world) if world and world.isdigit() else None, message)
    else:
        rendezvous.tell_rank0(path, int(rank), message)


def _given(argv: list[str], flag: str) -> str | None:
    """The value of `flag` on a command line (`FLAG VALUE` or `FLAG=VALUE`; the last one given)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _starts_the_run(args, env) -> bool:
    """Whether this process starts the run, and so says once what it makes of the environment:
    not a rank the launcher started (the launcher spoke), nor a torchrun or hand-started rank
    other than rank 0."""
    if "POCKETLLM_LAUNCH_RANK" in env:
        return False
    if "WORLD_SIZE" in env and env.get("RANK", "0") != "0":
        return False
    return getattr(args, "tp_rank", None) in (None, 0)

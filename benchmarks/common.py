"""What the benchmarks here share: the engine as one runner, the figures a decode step is measured
against (its weight bytes, the machine's read bandwidth, a step of GEMVs alone), a checkpoint to
run on, `pocketllm bench --json` in a fresh process, and median (min..max) formatting."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from pocketllm import compiled
from pocketllm.engine.timing import TimedRun, timed_prefill
from pocketllm.errors import UsageError
from pocketllm.ops.registry.kinds import activation_dtype
from pocketllm.quantization import parse_scheme


class Parser(argparse.ArgumentParser):
    """argparse as the CLI's parser (pocketllm.cli._Parser): a bad flag is one line,
    `PROG: error: MESSAGE`, exit code 2, not the whole usage block; and no prefix of a flag stands
    for it (a script that passes unknown flags on to `pocketllm bench` would take them)."""

    def __init__(self, *args, **kwargs):
        # Named after the script that builds it (its file), not sys.argv[0]: the same line whether
        # the script runs as a file or its main() is called in-process (by a test, or another script).
        kwargs.setdefault("prog", os.path.basename(sys._getframe(1).f_globals.get("__file__") or sys.argv[0]))
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def script(main):
    """main(argv) that reports pocketllm's own usage errors (a bad checkpoint, dtype, scheme,
    POCKETLLM_ISA, --json path, ...) as the CLI does: `NAME: error: MESSAGE`, exit code 2, no
    traceback; and Ctrl-C as the CLI does, `NAME: interrupted`, exit code 130 (the script's own
    cleanup, a server stopped or a temporary checkpoint removed, has run by then). Only these:
    anything else is a bug and keeps its traceback."""

    @functools.wraps(main)
    def run(argv=None):
        name = os.path.basename(getattr(sys.modules.get(main.__module__), "__file__", None) or sys.argv[0])
        try:
            return main(argv)
        except UsageError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            print(f"{name}: interrupted", file=sys.stderr)
            raise SystemExit(130) from None

    return run


def _type(name: str):
    """Names an argparse type function: argparse says `invalid NAME value` for its ValueError."""

    def named(fn):
        fn.__name__ = name
        return fn

    return named


def at_least(minimum: int):
    """An argparse type: an integer >= minimum."""

    @_type(f"integer >= {minimum}")
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = at_least(1)


@_type("number > 0")
def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, a rate)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


@_type("even count of reps")
def even_reps(text: str) -> int:
    """--reps: even and at least 2, so over the reps each order (alternate()) runs equally often."""
    value = int(text)
    if value < 2 or value % 2:
        raise argparse.ArgumentTypeError(f"must be even and at least 2 (each order runs equally often), got {value}")
    return value


def int_list(minimum: int = 1):
    """An argparse type: comma-separated integers, each >= minimum, as a list."""

    @_type("comma-separated integer list")
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes comma-separated integers, got {text!r}") from None
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"each must be >= {minimum}, got {text}")
        return values

    return parse


@_type("scheme list")
def scheme_list(text: str) -> list[str]:
    """Comma-separated --quantize schemes, each as the CLI accepts it, by its canonical name
    (int4 -> int4-g128); none is refused: every entry is a quantized format. '' is no scheme."""
    names = []
    for x in filter(None, text.split(",")):
        try:
            scheme = parse_scheme(x, "")
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc).strip()) from None
        if scheme is None:
            raise argparse.ArgumentTypeError(f"'none' is not a quantized format, got {text!r}")
        names.append(scheme.name)
    return names


@_type("file")
def existing_file(text: str) -> str:
    """An argparse type: a file that exists, as an absolute path (a script may run its peers in
    another directory)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no file {text}")
    return os.path.abspath(text)


@_type("directory")
def existing_dir(text: str) -> str:
    """An argparse type: a directory that exists, as an absolute path."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no directory {text}")
    return os.path.abspath(text)


@_type("path")
def absolute_path(text: str) -> str:
    """An argparse type: the path as the user meant it, from this directory, whatever directory
    the script runs the command that reads it in (pocketllm checks that it is a checkpoint)."""
    return os.path.abspath(text)


@_type("executable")
def executable(text: str) -> str:
    """An argparse type: a program that runs, a path or a name on PATH, as its absolute path:
    checked before the run, not found missing after the model loaded and warmed up."""
    found = shutil.which(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"{text} is not an executable")
    return os.path.abspath(found)


@_type("checkout")
def checkout(text: str) -> str:
    """An argparse type: a pocketllm checkout (a directory holding pocketllm/), as an absolute
    path: a bench runs from inside it, and a missing one is found before any setting runs."""
    if not os.path.isdir(os.path.join(text, "pocketllm")):
        raise argparse.ArgumentTypeError(f"{text} is not a pocketllm checkout (no {os.path.join(text, 'pocketllm')} directory)")
    return os.path.abspath(text)


@_type("NAME=VALUE")
def env_setting(text: str) -> tuple[str, str]:
    """An argparse type: NAME=VALUE, a variable set for a run, as (NAME, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"takes NAME=VALUE, got {text!r}")
    return name, value


@_type("switch")
def switch_name(text: str) -> str:
    """An argparse type: an environment variable pocketllm reads (pocketllm.switches, its seed
    aliases too): an A/B of a name it does not read times noise as an effect."""
    from pocketllm.switches import ALIASES, SETTINGS, nearest_name

    offered = [*SETTINGS, *ALIASES.values()]
    if text not in offered:
        raise argparse.ArgumentTypeError(f"pocketllm reads no variable {text}; the nearest it reads is {nearest_name(text, offered)}")
    return text


# `pocketllm bench` flags that name a path: made absolute before a bench runs in another directory
# (run_bench_json's cwd), so that they name what the user meant from here.
BENCH_PATH_FLAGS = ("--ckpt", "--token-ids-file", "--calibration", "--profile-out", "--trace-out")


def absolute_paths(bench_args: list[str]) -> list[str]:
    """bench_args with the value of every BENCH_PATH_FLAGS flag (`--ckpt DIR` or `--ckpt=DIR`) absolute."""
    out = list(bench_args)
    for i, arg in enumerate(out):
        flag, sep, value = arg.partition("=")
        if flag in BENCH_PATH_FLAGS and sep and value:
            out[i] = f"{flag}={os.path.abspath(value)}"
        elif i and out[i - 1] in BENCH_PATH_FLAGS and not arg.startswith("-"):
            out[i] = os.path.abspath(arg)
    return out


def machine() -> str:
    """The machine the figures were measured on, as the first line of a script's results."""
    return f"machine: {compiled.cpu_model()} ({platform.machine()}), torch {torch.__version__}"


def read_bandwidths_gbps(mib: int = 1024, reps: int = 5) -> dict[str, float]:
    """Memory read bandwidth: {"huge pages": GB/s, "plain pages": GB/s}, each the best of `reps`
    full fp32 sums over a buffer far beyond cache, interleaved. The streaming limit takes the
    faster: the engine keeps its weights on huge pages where the kernel allows."""
    from pocketllm import host_memory

    n = mib * 2**20 // 4
    buffers = {"huge pages": host_memory.zeros((n,), torch.float32).fill_(1), "plain pages": torch.ones(n, dtype=torch.float32)}
    best = dict.fromkeys(buffers, float("inf"))
    for _ in range(reps):
        for name, x in buffers.items():
            t0 = time.perf_counter()
            x.sum()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: n * 4 / seconds / 1e9 for name, seconds in best.items()}


def projection_weights(model) -> list[torch.Tensor]:
    """Every weight a decode step reads through a GEMV: the projections, then the head."""
    return model.projection_weights()


def gemv_only_step_seconds(model, reps: int = 5, op=None, rows: int = 1) -> float:
    """A decode step cut down to its GEMVs: op(x, w) for x of `rows` rows (one per sequence of the
    step) over the model's own projection and head weights, in module order, and nothing else;
    best of `reps` passes after one warm-up pass. Without `op`, each projection's own bound
    kernels run (the engine's choice for that many rows), which makes this the fastest a step can
    be with those kernels on this machine, whatever else is fused; any other op (decode_anatomy
    passes each candidate) is timed the same way, so the figures compare."""
    layers = model.projections()
    calls = [(m.kernels, m.weight) for m in layers]
    if op is not None:
        calls = [(functools.partial(op, w=w), w) for _, w in calls]
    xs = [torch.randn(rows, w.shape[1], dtype=activation_dtype(w)) for _, w in calls]
    best = float("inf")
    for i in range(reps + 1):
        t0 = time.perf_counter()
        for x, (run, _) in zip(xs, calls):
            run(x)
        if i:  # pass 0 is the warm-up
            best = min(best, time.perf_counter() - t0)
    return best


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors (a quantized weight's values, scales and zero points)."""
    return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes for t in tensors)


def temp_dir(prefix: str) -> str:
    """A new temporary directory, removed with what it holds when the process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def checkpoint_dir(args) -> str:
    """--ckpt, or --preset written as a checkpoint in a temporary directory, removed when the
    process exits: both engines (and every benchmark here) read the same safetensors."""
    if args.ckpt is not None:
        return args.ckpt
    from pocketllm.cli import main as cli

    ckpt = temp_dir("pocketllm-bench-")
    # Its "wrote ..." line is progress, not a result: stderr, out of the figures on stdout.
    with contextlib.redirect_stdout(sys.stderr):
        rc = cli(["make-checkpoint", "--preset", args.preset, "--out", ckpt, "--dtype", args.dtype])
    if rc:
        # It said why in one line (a bad --preset or --dtype); there is no checkpoint to run on.
        raise SystemExit(rc)
    return ckpt


def run_bench_json(bench_args: list[str], env: dict[str, str] | None = None, cwd=None) -> dict:
    """`python -m pocketllm bench *bench_args --json FILE` in a fresh process, and FILE's contents.

    `env` holds variables set over this process's environment; `cwd` is where the command runs,
    which also decides which tree `-m pocketllm` imports (the working directory comes first on
    sys.path); a path in bench_args means what it means here (absolute_paths). A failed run ends this process with the bench's last line of stderr,
    and exit code 2 where the bench refused its flags (flags this script passed on as given)."""
    with tempfile.TemporaryDirectory(prefix="pocketllm-bench-json-") as tmp:
        path = f"{tmp}/bench.json"
        cmd = [sys.executable, "-m", "pocketllm", "bench", *absolute_paths(bench_args), "--json", path]
        r = subprocess.run(cmd, check=False, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True)
        if r.returncode != 0:
            lines = r.stderr.strip().splitlines()
            print(f"pocketllm bench failed: {lines[-1]}" if lines else f"pocketllm bench failed with exit code {r.returncode} and no message", file=sys.stderr)
            raise SystemExit(2 if r.returncode == 2 else 1)
        with open(path) as f:
            return json.load(f)


def run_json_line(cmd: list[str], what: str, env: dict[str, str] | None = None) -> dict:
    """A child process's result: its last line of stdout, a JSON object. A failed run ends this
    process with `what` and the child's last line of stderr."""
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        raise SystemExit(f"{what} failed: {lines[-1] if lines else f'exit code {r.returncode}'}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def one_rank_plan(ckpt: str | None, dtype: torch.dtype | str, quantize: str | None = None, device: str = "cpu", preset: str | None = None,
                  layers: int | None = None):
    """A TP=1 run's model plan, planned and checked as the commands plan theirs: from the
    checkpoint, or (ckpt None) `preset` cut to `layers`."""
    from pocketllm.model_args import model_plan
    from pocketllm.run_plan import RunPlan, SourcePlan

    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return model_plan(RunPlan.one_rank(SourcePlan(ckpt=ckpt, preset=preset, layers=layers, dtype=name, quantize=quantize), torch.device(device).type))


class PocketRunner:
    name = "pocketllm"

    def __init__(self, ckpt: str | None, dtype: torch.dtype | str, quantize: str | None = None, device: str = "cpu", preset: str | None = None, layers: int | None = None):
        """`quantize`: a --quantize scheme the weights are quantized to at load (None: as stored),
        planned and checked as the commands plan theirs. Without a checkpoint, `preset`'s own
        random weights (cut to `layers`), drawn on `device`."""
        from pocketllm.distributed.policy import RulePolicy
        from pocketllm.distributed.state import set_tp
        from pocketllm.engine.runner import Engine

        plan = one_rank_plan(ckpt, dtype, quantize, device, preset, layers)
        set_tp(0, 1)
        self.cfg = plan.cfg
        self.device = torch.device(device)
        self.sync = device_sync(self.device)
        self.engine = Engine(plan.cfg, plan.open_source(self.device), plan.dtype, self.device, RulePolicy())
        self.vocab_size = plan.cfg.vocab_size

    def prefill(self, ids: list[int], measure=None):
        """Seconds of one prefill of ids from a fresh sequence; with `measure`, what measure(run
        the prefill) returns. The sequence is set up first (on CUDA that captures the decode
        step's graphs anew), outside what is timed or measured."""
        run = TimedRun(self.engine, [ids], 1, self.sync)
        result = run.prefill() if measure is None else measure(run.prefill)
        run.close()
        return result

    def decode(self, ids: list[int], n: int, measure=None):
        """Seconds of n greedy decode steps after a prefill of ids, through the generation loop
        `pocketllm bench` times, and the tokens: the prefill's, then the steps'. With `measure`,
        what measure(run the steps) returns in place of the seconds (a profile of them)."""
        _, run = timed_prefill(self.engine, ids, self.sync, room=n)
        result = run.decode(n) if measure is None else measure(lambda: run.decode(n))
        run.close()
        return result, run.tokens[0]


def parse_pairs(p, pairs: list[str]) -> list[tuple[str, str]]:
    """--pair SCHEME=GGUF values as (pocketllm --quantize scheme, GGUF path), `bf16` read as
    `none` (the checkpoint's own floats); a malformed pair or a missing file is p's usage error."""
    out = []
    for x in pairs:
        scheme, sep, gguf = x.partition("=")
        if not sep or not gguf:
            p.error(f"--pair takes SCHEME=GGUF, got {x!r}")
        if not os.path.isfile(gguf):
            p.error(f"--pair {x}: no file {gguf}")
        scheme = "none" if scheme == "bf16" else scheme
        try:
            parse_scheme(scheme, f"--pair {x}:")  # refused here, not when its model loads after the others
        except UsageError as exc:
            p.error(str(exc))
        out.append((scheme, os.path.abspath(gguf)))
    return out


def llama_bench_tests(cmd: list[str]) -> list[dict]:
    """The tests of one llama-bench run (`-o json`); its last stderr line, as one line, on failure."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        raise SystemExit(f"llama-bench failed: {lines[-1] if lines else f'exit code {r.returncode}'}")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"llama-bench printed no JSON test list ({cmd[0]} is not llama-bench, or too old for -o json)") from None


def _no_sync() -> None:
    """CPU ops are synchronous: nothing to wait for around a timing."""


def device_sync(device: torch.device):
    """What waits for `device`'s queued work (nothing on a CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "npu":
        return lambda: torch.npu.synchronize(device)
    return _no_sync


def alternate(items: list, rep: int) -> list:
    """The order to run `items` in on repetition `rep`: as given on even reps, reversed on odd
    ones, so that over an even number of reps each variant runs first as often as last and an
    order effect (a warmer cache, a quieter moment right after a rep's progress line) falls on
    both sides instead of on one."""
    return list(items) if rep % 2 == 0 else list(reversed(items))


def spread(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):{7 + digits}.{digits}f} ({min(xs):.{digits}f}..{max(xs):.{digits}f})"

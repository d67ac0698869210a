"""One command for a machine with a GPU or an Ascend NPU: print the versions that matter, run the
device tests (tests/device) and the device benches, and print one table of what passed and failed.

    python benchmarks/device_check.py                 # the device torch sees (cuda, else npu)
    python benchmarks/device_check.py --device npu
    python benchmarks/device_check.py --device cpu --quick   # a dry run of this script itself
    python benchmarks/device_check.py --out DIR      # every step's whole output kept in DIR

Every step runs in its own process with a time limit, so one that hangs or crashes is a FAIL
row, not the end of the check; one past its limit gets Ctrl-C first (pytest then reports the
tests that finished, and a test's server is stopped by its fixture). A figure that misses its
target (the batch-8 step against the batch-1 step) is a `miss` row, counted apart: figures are
reported, not enforced; a warm-up process that did not finish is a `warn` row (the timed steps
compile what they lack themselves); each group of tests/device ends with a `total` row, its whole
time (processes, collection and compiles beside the tests' own). Exit status: 0 when every step
passed (skips, misses and warnings allowed), 1 when any failed, 2 when there is no such device to
check.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A checkout that is not installed runs as one that is (a machine with no package index: the
# packages it lacks carried as wheels and put on PYTHONPATH, docs/devices.md); main() passes the
# same on to every step.
sys.path.insert(0, str(REPO))

from common import Parser  # noqa: E402


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_machine(kind: str) -> list[str]:
    import torch

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)})"]
    lines.append("libraries: " + ", ".join(f"{d} {_version(d)}" for d in ("fla-core", "flash-linear-attention", "triton", "torch_npu", "transformers")))
    if kind == "cuda":
        lines += [f"cuda:{i} {torch.cuda.get_device_name(i)}, capability {torch.cuda.get_device_capability(i)}" for i in range(torch.cuda.device_count())]
    elif kind == "npu":
        lines += [f"npu:{i} {torch.npu.get_device_name(i)}" for i in range(torch.npu.device_count())]
    return lines


def detect(requested: str) -> tuple[str | None, int]:
    """The device kind to check and how many there are; (None, 0) when there is none."""
    import torch

    npu = 0
    if requested in ("auto", "npu"):
        try:
            import torch_npu  # noqa: F401

            npu = torch.npu.device_count() if torch.npu.is_available() else 0
        except ImportError:
            npu = 0
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu":
        return "cpu", 1
    if requested == "cuda" or (requested == "auto" and cuda):
        return ("cuda", cuda) if cuda else (None, 0)
    return ("npu", npu) if npu else (None, 0)


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str, float]] = []
        self.docs: dict[str, object] = {}  # a step's whole result (a bench's --json), for --out

    def add(self, step: str, outcome: str, detail: str, seconds: float, doc: object = None) -> None:
        self.rows.append((step, outcome, detail, seconds))
        if doc is not None:
            self.docs[step] = doc
        if outcome != "skip":
            print(f"  {outcome:<7} {step} ({seconds:.1f} s) {detail}", file=sys.stderr, flush=True)

    def failed(self) -> int:
        return sum(1 for _, outcome, _, _ in self.rows if outcome == "FAIL")

    def missed(self) -> int:
        """Rows whose step ran but whose figure missed its target ("miss"): reported, not failed."""
        return sum(1 for _, outcome, _, _ in self.rows if outcome == "miss")

    def print(self) -> None:
        width = max(len(r[0]) for r in self.rows)
        print(f"{'step':<{width}}  {'result':<7} {'s':>6}  detail")
        for step, outcome, detail, seconds in self.rows:
            print(f"{step:<{width}}  {outcome:<7} {seconds:6.1f}  {detail}")


# Seconds a step past its limit has to end after Ctrl-C, before it is killed (inside its limit).
GRACE_S = 15
# --out's log, each step's command, exit and whole output appended as it ends (None: not kept).
LOG: Path | None = None
# One step's output at a time into it (the warm-up's processes end in threads of their own).
_LOG_WRITE = threading.Lock()


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, str, float]:
    """cmd's exit code (None: past its limit), stdout, stderr and seconds. Past timeout - GRACE_S
    its process group gets Ctrl-C, then SIGKILL once GRACE_S more have passed."""
    return _finish(cmd, env, *_start(cmd, env), timeout)


def _start(cmd: list[str], env: dict | None) -> tuple[subprocess.Popen, float]:
    # In the main thread: a fork running preexec_fn while other threads hold locks can deadlock.
    t0 = time.monotonic()
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_ctrl_c_heard, env=None if env is None else {**os.environ, **env}), t0


def _finish(cmd: list[str], env: dict | None, proc: subprocess.Popen, t0: float, timeout: float) -> tuple[int | None, str, str, float]:
    """_run's wait for a started process (see _run)."""
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout - GRACE_S))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        rc = None
    # What the step left running in its group (a server whose test was killed) goes with it.
    _signal_group(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - t0
    if LOG is not None:
        with _LOG_WRITE, LOG.open("a") as f:
            f.write(f"===== {' '.join(cmd)}\n{'' if env is None else f'with {env}'}\nexit {'(past its limit)' if rc is None else rc} "
                    f"after {seconds:.1f} s\n----- stdout\n{out}\n----- stderr\n{err}\n")
    return rc, out, err, seconds


def _ctrl_c_heard() -> None:
    """In the step's process before it starts: SIGINT's default action, which a check started in
    the background (`&` in a script) would otherwise pass on ignored, so Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def share(value: float, limit: str) -> str:
    """A measured share of a limit, "213% of the matmul limit"; over 100% it says the limit's
    measure was disturbed (a run cannot beat the rate it is bounded by), not a figure to read."""
    text = f"{100 * value:.0f}% of the {limit}"
    return text + " (over 100%: the limit's measure was disturbed)" if value > 1 else text


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


# tests/device in four steps. The engine's own device tests (runs against the oracle, the
# captured graphs, the GDN kernels) come first; after the figures, so that a short lease gets
# those, more runs of the CLI and the engine against their own numbers elsewhere (a dozen
# processes, and fla compiled for another model's heads), the serve tests (two servers, each first
# start compiling fla's kernels for the model's heads) and the files that hold each Triton kernel
# to its torch form case by case (dozens of kernel variants to compile on a cold cache).
RUNS = ("test_device_cli_runs.py", "test_gdn_passes_on_cuda.py")
SERVE = ("test_serve_on_cuda.py",)
KERNEL_CASES = ("test_device_ops_on_cuda.py", "test_gated_delta_rows_on_cuda.py", "test_decode_attention_on_cuda.py")


def device_test_files(group: str) -> list[str]:
    """tests/device's files of a group: "runs", "serve", "kernel cases", or "engine" (every other
    one)."""
    files = sorted((REPO / "tests" / "device").glob("test_*.py"))
    named = {"runs": RUNS, "serve": SERVE, "kernel cases": KERNEL_CASES}
    if group in named:
        return [str(f) for f in files if f.name in named[group]]
    return [str(f) for f in files if f.name not in RUNS + SERVE + KERNEL_CASES]


def device_tests(table: Table, timeout: float, group: str = "engine") -> None:
    """A group of tests/device's files under pytest (device_test_files), one row per test, read
    from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "device.xml"
        # A file that cannot be collected (an import its machine lacks) is a failed row of its
        # own, not the end of the step's other files.
        rc, out, err, seconds = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                                      f"--junitxml={xml}", *device_test_files(group)], timeout)
        if not xml.exists():
            why = "timed out" if rc is None else f"exit {rc}"
            table.add(f"tests/device {group}", "FAIL", f"pytest {why}: {_last_line(err or out)}", seconds)
            return
        skips: dict[str, int] = {}
        counts = {"pass": 0, "FAIL": 0, "skip": 0}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).stem}::{case.get('name')}"
            problem = next((case.find(tag) for tag in ("failure", "error") if case.find(tag) is not None), None)
            skipped = case.find("skipped")
            if problem is not None:
                # A file that could not be collected says only "collection failure": its error's
                # last line (an import the machine lacks) says why.
                message = (problem.get("message") or "").strip()
                why = _last_line(problem.text or "") if message in ("", "collection failure") else message.splitlines()[0][:200]
                table.add(name, "FAIL", why, float(case.get("time", 0)))
                counts["FAIL"] += 1
            elif skipped is not None:
                # One row per reason: the other device's tests skip here by design.
                reason = (skipped.get("message") or "").removeprefix("Skipped: ")[:200]
                skips[reason] = skips.get(reason, 0) + 1
                counts["skip"] += 1
            else:
                table.add(name, "pass", "", float(case.get("time", 0)))
                counts["pass"] += 1
        for reason, n in skips.items():
            table.add(f"tests/device {group}: {n} test(s)", "skip", reason, 0.0)
        if counts["pass"] + counts["FAIL"]:
            # The step's whole time (its processes' starts, collection and compiles beside the
            # tests' own), what the check's budget pays.
            table.add(f"tests/device {group}", "total", f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped", seconds)
        if rc is None:
            table.add(f"tests/device {group}", "FAIL", "pytest timed out: the rows above are the tests that finished", seconds)


def fla_imports(table: Table, timeout: float) -> None:
    """Whether fla imports (the `cuda` extra): without it both engines' figures are of their torch
    paths (pocketllm's GDN the torch chunked kernel, transformers' Qwen3.5 its torch forms)."""
    rc, _, err, seconds = _run([sys.executable, "-c", "import fla.ops.gated_delta_rule"], timeout)
    if rc == 0:
        table.add("fla imports", "pass", f"fla-core {_version('fla-core')}", seconds)
    else:
        table.add("fla imports", "FAIL", f"{'timed out' if rc is None else _last_line(err)}: the figures below are of both engines' "
                  f"torch paths (install the cuda extra, or its wheels: docs/devices.md)", seconds)


# Which of Triton's and fla's switches keep autotuning timings on disk: off in the warm-up's
# processes, whose timings are taken side by side on one device (the timed steps tune again, alone,
# from the compiled kernels the warm-up left in the cache).
UNKEPT_TIMINGS = {"TRITON_CACHE_AUTOTUNING": "0", "FLA_CACHE_RESULTS": "0"}


def warm_up(table: Table, kind: str, runs: dict[str, list[str]], timeout: float) -> bool:
    """benchmarks/vs_transformers.py --warm-up-only for each engine at each of `runs`' shapes, all
    at once: each compiles its own kernels (fla's autotuning compiles every config, once per head
    layout: about 90 s each, one after another were the steps to do it themselves) into Triton's
    on-disk cache, on cores that would otherwise be idle. A row each, `warn` where one did not
    finish (the timed step compiles what it lacks itself; its own row says whether it ran); True
    when all passed. Stopped (Ctrl-C), it takes its processes with it."""
    jobs = {f"warm-up: {name}, {engine}": [sys.executable, "benchmarks/vs_transformers.py", "--device", kind, *args, "--warm-up-only", "--engine", engine]
            for name, args in runs.items() for engine in ("pocketllm", "transformers")}
    started: dict[str, tuple[list[str], tuple[subprocess.Popen, float]]] = {}
    pool = ThreadPoolExecutor(len(jobs))
    try:
        for step, cmd in jobs.items():
            started[step] = (cmd, _start(cmd, UNKEPT_TIMINGS))
        # Each read in a thread of its own: a process whose pipe is not read stops when it fills.
        done = {step: pool.submit(_finish, cmd, UNKEPT_TIMINGS, *proc_t0, timeout) for step, (cmd, proc_t0) in started.items()}
        results = {step: future.result() for step, future in done.items()}
    finally:
        # On the way out of an interruption: each process group killed, so the reads end.
        for _, (proc, _) in started.values():
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
        pool.shutdown(wait=True)
    passed = True
    for step, (rc, out, err, seconds) in results.items():
        if rc == 0:
            table.add(step, "pass", _last_line(out), seconds)
        else:
            passed = False
            table.add(step, "warn", f"{'timed out' if rc is None else f'exit {rc}: {_last_line(err)}'} (the timed steps compile for "
                      f"themselves)", seconds)
    return passed


# Seconds the warm-up leaves of the budget for the two figures after it (the 27B layers against
# transformers, the 64-layer bench): a warm-up that hangs must not cost them their turn.
WARM_UP_LEAVES = 210


def keep(out: Path, machine: list[str], table: Table) -> None:
    """--out: the table with every step's figures, rewritten after each step (a check cut short
    keeps what it did; the log beside it grows as each step ends)."""
    rows = [dict(zip(("step", "result", "detail", "seconds"), row)) for row in table.rows]
    (out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows, "results": table.docs}, indent=1) + "\n")


def gdn_bench(table: Table, kind: str, dtype: str, tokens: int, reps: int, timeout: float) -> None:
    step = f"gdn-bench --device {kind} --dtype {dtype} --tokens {tokens}"
    rc, out, err, seconds = _run([sys.executable, "-m", "pocketllm", "gdn-bench", "--device", kind, "--dtype", dtype, "--tokens", str(tokens), "--reps", str(reps)], timeout)
    if rc != 0:
        table.add(step, "FAIL", "timed out" if rc is None else f"exit {rc}: {_last_line(err)}", seconds)
        return
    summary = json.loads(_last_line(out))
    detail = f"device kernel {summary['device_kernel']}"
    if summary["device_kernel_vs_chunked"] is not None:
        detail += f" at {summary['device_kernel_vs_chunked']:.3f}x the torch chunked kernel's time"
    table.add(step, "pass", f"{detail}; recurrence at {summary['vs_recurrent']:.2f}x; all outputs agree", seconds, summary)


def bench(table: Table, kind: str, world: int, preset: str, tokens: int, extra: list[str], timeout: float, env: dict | None = None,
          warm: bool = False) -> dict | None:
    """One `pocketllm bench` run: a row with its figures, and its --json document (None when it
    failed). warm: the steps before left its kernels in Triton's cache (its ready time is then a
    second start's)."""
    step = "".join(f"{k}={v} " for k, v in (env or {}).items())
    step += f"bench --device {kind} --tp-world {world} --preset {preset} --prompt-tokens {tokens}" + (f" {' '.join(extra)}" if extra else "")
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "pocketllm", "bench", "--device", kind, "--tp-world", str(world), "--preset", preset,
               "--prompt-tokens", str(tokens), "--max-new-tokens", "32", "--dist-timeout", "120", "--limits", "--json", str(out_json), *extra]
        for i, flag in enumerate(cmd):
            if flag == "DIR":
                cmd[i] = str(Path(tmp) / "profile")
        rc, out, err, seconds = _run(cmd, timeout, env)
        if rc != 0:
            table.add(step, "FAIL", "timed out" if rc is None else f"exit {rc}: {_last_line(err)}", seconds)
            return None
        doc = json.loads(out_json.read_text())
    s, lim = doc["settings"], doc.get("limits", {})
    shares = (f" ({share(lim['prefill_share_of_matmul_limit'], 'matmul limit')})", f" ({share(lim['decode_share_of_memory_limit'], 'memory limit')})") if lim else ("", "")
    ready = f"ready in {doc['ready_seconds']:.0f} s{' (Triton cache warm)' if warm else ''}, " if "ready_seconds" in doc else ""
    # What ran: a device op or kernel that failed its probe leaves the torch forms running, slowly.
    ran = f"{doc.get('decode_step', '')} {s['decode_step']}, {s['device_ops']}, gdn kernel {s['gdn_kernel_line']}, backend {s['backend']}"
    table.add(step, "pass", f"{ready}prefill {doc['prefill_tokens_per_s']:.0f} tok/s{shares[0]}, "
                            f"decode {doc['decode_tokens_per_s']:.1f} tok/s{shares[1]}, {ran}", seconds, doc)
    # --kernel-profile's tables, as rank 0 printed them.
    for line in (err.splitlines() if "kernel_profile" in doc else []):
        if line.startswith(("kernel profile, ", "  ")):
            print(f"    {line}", file=sys.stderr)
    return doc


# Issue 38's target for a batch-8 decode step against a batch-1 step.
BATCH_8_TARGET = 1.3
# Seconds the batch-8 run needs at least (a model's load, warm-up and 128 steps).
BATCH_8_NEEDS = 45


def batch_scaling(table: Table, kind: str, preset: str, tokens: int, extra: list[str], left) -> None:
    """bench at batch 1 and at batch 8 on the same shapes, each a row, then a row setting a step of
    eight sequences' rows against a step of one (issue 38's target: at most 1.3x)."""
    one = bench(table, kind, 1, preset, tokens, extra, left())
    eight = bench(table, kind, 1, preset, tokens, [*extra, "--batch", "8"], left()) if left() >= BATCH_8_NEEDS else None
    if one is None or eight is None:
        return
    # Steps a second: a batch of B decodes B tokens a step.
    step_1, step_8 = 1 / one["decode_tokens_per_s"], 1 / eight["decode_tokens_per_s_per_sequence"]
    # The steps ran (their rows passed); this row is the figure against its target.
    outcome = "pass" if step_8 / step_1 <= BATCH_8_TARGET else "miss"
    table.add(f"a batch-8 decode step against a batch-1 step, {preset} {' '.join(extra)}", outcome,
              f"{1e3 * step_8:.2f} ms against {1e3 * step_1:.2f} ms: {step_8 / step_1:.2f}x (the target: <= {BATCH_8_TARGET}x)", 0.0)


def vs_transformers(table: Table, kind: str, args: list[str], timeout: float) -> None:
    """benchmarks/vs_transformers.py on the device: one row with both engines' figures, their
    ratios and pocketllm's shares of the limits."""
    step = f"vs_transformers --device {kind} {' '.join(args)}"
    rc, out, err, seconds = _run([sys.executable, "benchmarks/vs_transformers.py", "--device", kind, *args], timeout)
    if rc != 0:
        table.add(step, "FAIL", "timed out" if rc is None else f"exit {rc}: {_last_line(err)}", seconds)
        return
    s = json.loads(out.strip().splitlines()[-1])
    parts = [f"{k.removesuffix('_ratio')} {v:.2f}x" for k, v in s.items() if k.endswith("_ratio")]
    parts += [f"{k} {share(v, 'limit')}" for k, v in s.items() if "share" in k]
    if "greedy_tokens_equal" in s:
        # From one checkpoint both engines read: tokens apart are worth a look in the log (in bf16
        # a near tie may part two right engines).
        parts.append("greedy tokens equal" if s["greedy_tokens_equal"] else "greedy tokens DIFFER (the log has both)")
    table.add(step, "pass", "; ".join(parts), seconds, s)
    for line in out.strip().splitlines()[:-1]:
        print(f"    {line}", file=sys.stderr)


# A step that would start with less than this left is skipped rather than cut short.
STEP_MIN_S = 20


def _seconds(text: str) -> float:
    """--timeout and --budget: seconds, at least STEP_MIN_S (with less no step would start, and
    the table would read as a check that passed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not STEP_MIN_S <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be at least {STEP_MIN_S} s (a step needs that to start), got {text}")
    return value


def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "npu", "cpu"), help="what to check (cpu: a dry run of this script)")
    p.add_argument("--quick", action="store_true", help="small shapes only (a dry run's speed)")
    p.add_argument("--timeout", type=_seconds, default=300, help="seconds each step may take at most (default 300)")
    p.add_argument(
        "--budget", type=_seconds, default=480,
        help=f"seconds the whole check may take (default 480): each step gets what is left, and a step that would start with "
        f"less left than it needs ({STEP_MIN_S} s to two minutes) is skipped (the device is lent briefly: the check must end "
        f"inside its lease)",
    )
    p.add_argument("--out", type=Path, help="a folder to keep device_check.log (each step's command, exit and whole output) and results.json "
                   "(the table and each step's figures, a bench's --json document whole) in, rewritten after each step")
    args = p.parse_args(argv)
    global LOG
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        LOG = args.out / "device_check.log"
        LOG.write_text("")
    start = time.monotonic()

    def left(cap: float) -> float:
        return min(cap, args.budget - (time.monotonic() - start))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    kind, count = detect(args.device)
    if kind is None:
        print(f"device_check: no {'CUDA or Ascend' if args.device == 'auto' else args.device} device is visible to torch; nothing to check", file=sys.stderr)
        for line in describe_machine("cpu"):
            print(line)
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    machine = describe_machine(kind)
    for line in machine:
        print(line)
    table = Table()
    tokens = 256 if args.quick else 4096
    preset, prompt = ("tiny", 64) if args.quick else ("small", 2048)
    # The big shapes: the 27B's layers, four of them against transformers, all 64 alone.
    big, big_prompt = ("small", 256) if args.quick else ("qwen3.8-27b", 4096)
    batch_prompt = 64 if args.quick else 512
    vs_small = ["--preset", preset, "--lengths", str(prompt), "--decode-tokens", "16" if args.quick else "64", "--reps", "2"]
    # With each engine's kernels by device time, side by side: where the 27B layers' time goes.
    vs_big = ["--preset", big, "--layers", "4", "--random-weights", "--lengths", str(big_prompt), "--decode-tokens", "16" if args.quick else "64", "--reps", "2",
              "--kernel-profile"]
    # Four of the 27B's layers; 128 decode steps a run (each step a few milliseconds): the batch-8
    # against batch-1 ratio divides two runs' single timings, which 32 steps would leave noisy.
    batch_flags = ["--layers", "4", "--max-new-tokens", "32" if args.quick else "128"]
    # In the order of what a short lease must not miss: the figures first, the tests after.
    # Each step: (name, the seconds it needs at least to be worth starting, the step).
    warmed: list[bool] = []
    steps = [("fla imports", STEP_MIN_S, lambda: fla_imports(table, left(60)))] if kind == "cuda" else []
    if kind != "npu":
        # Both engines' kernels at both shapes compiled side by side, before any is timed (on a
        # CPU, a dry run of the step).
        warm_limit = lambda: max(STEP_MIN_S, min(args.timeout, left(float("inf")) - WARM_UP_LEAVES))  # noqa: E731
        steps.append(("warm-up", 120, lambda: warmed.append(warm_up(table, kind, {"27B shapes x4": vs_big, "small": vs_small}, warm_limit()))))
    steps += [
        ("vs transformers, 27B shapes x4", 90, lambda: vs_transformers(table, kind, vs_big, left(args.timeout))),
        # Its layers' kernels are those of the step before: in Triton's cache, where the warm-up passed.
        ("bench 27B, every layer", 120, lambda: bench(table, kind, 1, big, big_prompt, [], left(args.timeout), warm=kind == "cuda" and any(warmed))),
        # Eight sequences' decode rows a step (the captured graphs' bucket 8 on a GPU) against one
        # sequence's, at four layers of the 27B's shapes.
        ("bench batch 1 and 8", 90, lambda: batch_scaling(table, kind, big, batch_prompt, batch_flags, lambda: left(args.timeout))),
        ("vs transformers, small", 90, lambda: vs_transformers(table, kind, vs_small, left(args.timeout))),
        ("tests/device engine", 90, lambda: device_tests(table, left(args.timeout))),
        # Batch 8 asked for batch invariance (a device's batch-invariant shape): what it costs.
        ("bench batch 8, batch-invariant", 60, lambda: bench(table, kind, 1, big, batch_prompt, [*batch_flags, "--batch", "8"], left(args.timeout),
                                                             {"POCKETLLM_BATCH_INVARIANT": "1"})),
        ("tests/device runs", 90, lambda: device_tests(table, left(args.timeout), "runs")),
        ("tests/device serve", 120, lambda: device_tests(table, left(args.timeout), "serve")),
        ("tests/device kernel cases", 60, lambda: device_tests(table, left(args.timeout), "kernel cases")),
        ("gdn-bench bfloat16", 30, lambda: gdn_bench(table, kind, "bfloat16", tokens, 2 if args.quick else 5, left(args.timeout))),
        ("bench tp1 host profile", 30, lambda: bench(table, kind, 1, "tiny", 64, ["--host-profile", "--profile-out", "DIR"], left(args.timeout))),
        ("gdn-bench float32", 30, lambda: gdn_bench(table, kind, "float32", tokens, 2 if args.quick else 3, left(args.timeout))),
    ]
    if count >= 2 and kind != "cpu":
        steps.append(("bench tp2", 60, lambda: bench(table, kind, 2, preset, prompt, [], left(args.timeout))))
        if kind == "cuda":
            # The decode step captured with its all-reduces (opt-in at TP>1 until this row passes).
            steps.append(("bench tp2, captured", 60, lambda: bench(table, kind, 2, preset, prompt, [], left(args.timeout), {"POCKETLLM_CUDA_GRAPH": "1"})))
    for name, needs, step in steps:
        # A step started with less than it needs would be cut short and read as a failure.
        if left(args.timeout) < min(needs, args.timeout):
            table.add(name, "skip", f"out of the check's --budget of {args.budget:g} s (it needs about {needs} s)", 0.0)
            continue
        # A step whose output this script cannot read is a failed step, not the end of the check.
        try:
            step()
        except Exception as exc:
            table.add(name, "FAIL", f"device_check could not read its result: {type(exc).__name__}: {exc}"[:200], 0.0)
        if args.out is not None:
            keep(args.out, machine, table)
    print()
    table.print()
    failed, missed = table.failed(), table.missed()
    print(f"\n{failed} step(s) failed" if failed else "\nevery step passed or was skipped")
    if missed:
        print(f"{missed} figure(s) missed their target (rows 'miss': measured and reported, not a failure)")
    warned = sum(1 for _, outcome, _, _ in table.rows if outcome == "warn")
    if warned:
        print(f"{warned} warm-up process(es) did not finish (rows 'warn': the steps after them compiled what they lacked themselves)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

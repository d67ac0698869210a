"""What the benchmarks here share: the engine as one runner, the figures a decode step is measured
against (its weight bytes, the machine's read bandwidth, a step of GEMVs alone), a checkpoint to
run on, `pocketllm bench --json` in a fresh process, and median (min..max) formatting."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from pocketllm.engine.timing import TimedRun, timed_prefill
from pocketllm.ops.registry.kinds import activation_dtype


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


def checkpoint_dir(args) -> str:
    """--ckpt, or --preset written as a checkpoint in a temporary directory, removed when the
    process exits: both engines (and every benchmark here) read the same safetensors."""
    if args.ckpt is not None:
        return args.ckpt
    from pocketllm.cli import main as cli

    ckpt = tempfile.mkdtemp(prefix="pocketllm-bench-")
    atexit.register(shutil.rmtree, ckpt, ignore_errors=True)
    cli(["make-checkpoint", "--preset", args.preset, "--out", ckpt, "--dtype", args.dtype])
    return ckpt


def run_bench_json(bench_args: list[str], env: dict[str, str] | None = None, cwd=None) -> dict:
    """`python -m pocketllm bench *bench_args --json FILE` in a fresh process, and FILE's contents.

    `env` holds variables set over this process's environment; `cwd` is where the command runs,
    which also decides which tree `-m pocketllm` imports (the working directory comes first on
    sys.path). A failed run ends this process with the bench's last line of stderr."""
    with tempfile.TemporaryDirectory(prefix="pocketllm-bench-json-") as tmp:
        path = f"{tmp}/bench.json"
        cmd = [sys.executable, "-m", "pocketllm", "bench", *bench_args, "--json", path]
        r = subprocess.run(cmd, check=False, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True)
        if r.returncode != 0:
            lines = r.stderr.strip().splitlines()
            raise SystemExit(f"pocketllm bench failed: {lines[-1]}" if lines else f"pocketllm bench failed with exit code {r.returncode} and no message")
        with open(path) as f:
            return json.load(f)


class PocketRunner:
    name = "pocketllm"

    def __init__(self, ckpt: str | None, dtype: torch.dtype | str, quantize: str | None = None, device: str = "cpu", preset: str | None = None, layers: int | None = None):
        """`quantize`: a --quantize scheme the weights are quantized to at load (None: as stored),
        planned and checked as the commands plan theirs. Without a checkpoint, `preset`'s own
        random weights (cut to `layers`), drawn on `device`."""
        from pocketllm.distributed.policy import RulePolicy
        from pocketllm.distributed.state import set_tp
        from pocketllm.engine.runner import Engine
        from pocketllm.model_args import model_plan
        from pocketllm.run_plan import RunPlan, SourcePlan

        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        kind = torch.device(device).type
        plan = model_plan(RunPlan.one_rank(SourcePlan(ckpt=ckpt, preset=preset, layers=layers, dtype=name, quantize=quantize), kind))
        set_tp(0, 1)
        self.cfg = plan.cfg
        self.device = torch.device(device)
        self.sync = device_sync(self.device)
        self.engine = Engine(plan.cfg, plan.open_source(self.device), plan.dtype, self.device, RulePolicy())

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
        out.append(("none" if scheme == "bf16" else scheme, gguf))
    return out


def llama_bench_tests(cmd: list[str]) -> list[dict]:
    """The tests of one llama-bench run (`-o json`); its last stderr line, as one line, on failure."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        raise SystemExit(f"llama-bench failed: {lines[-1] if lines else f'exit code {r.returncode}'}")
    return json.loads(r.stdout)


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

"""How fast one-row GEMVs stream weights, by how the cores are used: one process with every
allowed core's threads (TP=1), one thread on one core alone, and one single-thread process per
core at once (TP=N, every rank streaming its own weights). TP on one host pays for decode only
where the last beats the first.

    python benchmarks/core_bandwidth.py [--mib 288] [--reps 10] [--kernel c-prefetch]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from common import Parser, machine, positive_int, script
from pocketllm.errors import UsageError


def stream_gbps(mib: int, reps: int, kernel: str, start_at: float | None = None) -> float:
    """GB/s of the one-row kernel `kernel` over `mib` MiB of 3072x1024 bf16 weights, the best of
    `reps` passes; the passes begin at the wall clock time `start_at` when given, so processes
    measuring side by side stream at once."""
    from pocketllm.ops.registry import ONE_ROW

    why = ONE_ROW.by_name[kernel].unavailable("bfloat16", torch.device("cpu"))
    if why:
        raise UsageError(f"--kernel {kernel}: {why}")
    run = ONE_ROW.by_name[kernel].run
    count = max(1, mib * 2**20 // (3072 * 1024 * 2))
    weights = [torch.randn(3072, 1024, dtype=torch.bfloat16) for _ in range(count)]
    x, out = torch.randn(1024, dtype=torch.bfloat16), torch.empty(3072, dtype=torch.bfloat16)
    run(x, weights[0], out)  # builds or loads the compiled kernel before the start
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in weights:
            run(x, w, out)
        best = min(best, time.perf_counter() - t0)
    return count * 3072 * 1024 * 2 / best / 1e9


@script
def main(argv=None) -> int:
    from pocketllm.ops.registry import ONE_ROW

    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--mib", type=positive_int, default=288, help="weight MiB streamed per pass (default 288, the small preset's)")
    p.add_argument("--reps", type=positive_int, default=10)
    p.add_argument("--kernel", default="c-prefetch", choices=sorted(ONE_ROW.by_name), help="the one-row kernel that streams (default c-prefetch)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # one measurement on this core
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        os.sched_setaffinity(0, {args.worker})
        torch.set_num_threads(1)
        print(f"{stream_gbps(args.mib, args.reps, args.kernel, args.start_at):.2f}", flush=True)
        return 0
    cores = sorted(os.sched_getaffinity(0))
    worker = [sys.executable, __file__, "--mib", str(args.mib), "--reps", str(args.reps), "--kernel", args.kernel, "--worker"]
    torch.set_num_threads(len(cores))
    print(machine())
    print(f"kernel {args.kernel}; {len(cores)} cores, one process, {len(cores)} threads: {stream_gbps(args.mib, args.reps, args.kernel):.1f} GB/s")
    for c in cores:
        alone = float(subprocess.run([*worker, str(c)], capture_output=True, text=True, check=True).stdout)
        print(f"core {c} alone, one thread: {alone:.1f} GB/s")
    # Each starts streaming at the same moment, after its start-up and allocation.
    start = ["--start-at", str(time.time() + 8)]
    procs = [subprocess.Popen([*worker, str(c), *start], stdout=subprocess.PIPE, text=True) for c in cores]
    each = [float(proc.communicate()[0]) for proc in procs]
    print(f"one process per core at once: {' + '.join(f'{g:.1f}' for g in each)} = {sum(each):.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time from an injected rank fault to the launcher's error line and to its exit.

    python benchmarks/fault_timing.py [--runs 5]

Each case starts `pocketllm generate --preset tiny` with POCKETLLM_FAULT set, and times from the
fault's note on stderr (a killed rank dies right after printing it; a hung one sleeps, and the
error comes when a peer's collective times out) to the launcher's error line and to the
launcher's exit; prints median (min..max) per case.
"""

import os
import subprocess
import sys
import threading
import time

from common import Parser, positive_int, spread

PROMPT = ",".join(str((7 * i + 3) % 997) for i in range(40))


def one(world, fault, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", POCKETLLM_FAULT=fault)
    cmd = [sys.executable, "-m", "pocketllm", "generate", "--preset", "tiny", "--tp-world", str(world),
           "--token-ids", PROMPT, "--max-new-tokens", "8", "--dist-timeout", str(timeout)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    t = threading.Thread(target=lambda: [lines.append((time.monotonic(), l)) for l in p.stderr])
    t.start()
    p.wait()
    end = time.monotonic()
    t.join()
    fault_t = next(tl for tl, l in lines if "injected fault" in l)
    error_t = next(tl for tl, l in lines if l.startswith("pocketllm: error: rank"))
    return error_t - fault_t, end - fault_t, lines[-1][1].strip()


if __name__ == "__main__":
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--runs", type=positive_int, default=5, help="runs per case (default 5)")
    n = p.parse_args().runs
    cases = [
        ("kill rank 1 of 2 at prefill", 2, "rank=1,at=prefill,kind=kill", 30),
        ("kill rank 3 of 4 at decode", 4, "rank=3,at=decode,kind=kill", 30),
        ("hang rank 1 of 2 at decode, --dist-timeout 3", 2, "rank=1,at=decode,kind=hang", 3),
    ]
    for name, world, fault, timeout in cases:
        runs = [one(world, fault, timeout) for _ in range(n)]
        print(f"{name} ({n} runs)")
        print(f"  fault -> launcher's error line: {spread([r[0] for r in runs], 2)} s")
        print(f"  fault -> launcher exits:        {spread([r[1] for r in runs], 2)} s")
        print(f"  last line: {runs[-1][2]}")

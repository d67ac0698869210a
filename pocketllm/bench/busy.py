"""A busy machine on demand: one spinning process per CPU this process may run on, for as long as
a `with` block runs. What a measurement made beside other work does (the kernel registry's trust
checks, benchmarks/busy_cache.py) is seen by making that work."""

from __future__ import annotations

import os
import subprocess
import sys
import time


class BusyLoops:
    def __init__(self, settle: float = 0.5):
        self.settle = settle  # seconds for the loops to be running on every CPU before the block

    def __enter__(self):
        n = len(os.sched_getaffinity(0))
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        time.sleep(self.settle)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()

"""The memory of `pocketllm serve` under steady load: N clients, each sending request after request
of one kind with a prompt of its own every time (random words, so nothing is shared unless the
cache keeps it), for --seconds; the RSS of the server's processes (the engine and its HTTP process)
every --every seconds, then where it levelled (the last third's median), the prefix cache's entries
(/metrics) and after an idle pause. What docs/serving.md's "Prefix caching" table was measured with.

    python benchmarks/serve_memory.py [--ckpt DIR | --preset small] [--kind completion|scoring]
        [--clients 4] [--seconds 210] [--every 10] [--max-len 8192] [--serve-flag=--no-enable-prefix-caching]

`completion`: 600 characters of words, max_tokens 32, greedy. `scoring`: the same, echo with logprobs 5 and
max_tokens 0 (an evaluation harness's loglikelihood request: every prompt row's logits).
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from common import Parser, checkpoint_dir, machine, positive_float, script
from serve_load import start_server, stop_server

from pocketllm.serving.metrics import parse

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi "
         "omega").split()
# Characters of a prompt: 600 tokens with make-checkpoint's byte-level tokenizer.
PROMPT_CHARS = 600


def body(kind: str, rng: random.Random, model: str) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(PROMPT_CHARS // 3))[:PROMPT_CHARS]
    if kind == "scoring":
        return {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 5}
    return {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0}


def rss_mib(pid: int) -> float:
    """VmRSS of the process and its children (the HTTP process), MiB."""
    total = 0
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, children)]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def cached_prefixes(addr: str) -> str:
    host, port = addr.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    entries = parse(conn.getresponse().read().decode()).get("pocketllm_prefix_cache_entries")
    return "-" if entries is None else f"{entries:.0f}"


@script
def main(argv=None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--ckpt", help="checkpoint with tokenizer.json (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp-world", type=int, default=1)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-len", type=int, default=8192, help="serve's --max-len (default 8192, serve's own; the pool, and so how many "
                   "prefixes can be cached, is --max-running of these)")
    p.add_argument("--kind", choices=("completion", "scoring"), default="completion")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=positive_float, default=210, help="of load (default 210)")
    p.add_argument("--every", type=positive_float, default=10, help="seconds between RSS readings (default 10)")
    p.add_argument("--idle", type=positive_float, default=20, help="seconds idle after the load before the last reading (default 20)")
    p.add_argument("--serve-flag", action="append", default=[], help="a flag for serve (repeat; write --serve-flag=--no-...)")
    args = p.parse_args(argv)
    for name in ("clients", "max_running", "tp_world"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len < 1024:
        p.error(f"--max-len must be >= 1024 (a prompt is {PROMPT_CHARS} tokens and more), got {args.max_len}")
    ckpt = checkpoint_dir(args)
    proc, addr, lines = start_server(args, ckpt, max_len=args.max_len, extra=args.serve_flag)
    errors: list[str] = []
    done = [0]
    try:
        host, port = addr.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        t0 = time.monotonic()

        def client(i: int) -> None:
            rng = random.Random(i)
            c = http.client.HTTPConnection(host, int(port), timeout=600)
            while time.monotonic() - t0 < args.seconds:
                c.request("POST", "/v1/completions", body=json.dumps(body(args.kind, rng, model)), headers={"Content-Type": "application/json"})
                r = c.getresponse()
                answer = r.read()
                if r.status != 200:
                    errors.append(f"HTTP {r.status}: {answer[:200]!r}")
                    return
                done[0] += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        readings = []
        print(f"{'s':>6} {'RSS MiB':>9} {'requests':>9} {'cached prefixes':>16}", flush=True)
        while any(t.is_alive() for t in threads):
            time.sleep(args.every)
            readings.append(rss_mib(proc.pid))
            print(f"{time.monotonic() - t0:6.0f} {readings[-1]:9.0f} {done[0]:9d} {cached_prefixes(addr):>16}", flush=True)
        time.sleep(args.idle)
        idle = rss_mib(proc.pid)
        entries = cached_prefixes(addr)
    finally:
        rc = stop_server(proc)
    if errors or rc != 0:
        raise SystemExit(f"failed: {errors[:3]}, server exit {rc}:\n" + "".join(lines[-5:]))
    level = statistics.median(readings[-max(1, len(readings) // 3) :])
    print(machine())
    print(f"serve {' '.join(args.serve_flag) or '(defaults)'}, {args.kind}, {args.clients} clients, {args.seconds:g} s: "
          f"{done[0]} requests; RSS first {readings[0]:.0f} MiB, levelled at {level:.0f} MiB, "
          f"{idle:.0f} MiB after {args.idle:g} s idle; {entries} prefixes cached")
    return 0


if __name__ == "__main__":
    sys.exit(main())

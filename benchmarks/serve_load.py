"""Load on `pocketllm serve`: N concurrent streaming clients on loopback, a fixed request mix,
bounded in count and in time; reports requests/s, output tokens/s, time to first token and
inter-token latency percentiles per client count, and fails if any request failed or was lost.

Starts the server itself (on --ckpt, or --preset written as a checkpoint to a temporary
directory), runs one warm-up request, then each --clients level in turn against the same server,
--reps times with the levels' order reversed every other rep (so neither level always runs
first), and stops it with SIGINT. With several reps the summary is each level's median. Each client sends its requests one after another; request i of the run
takes mix entry i (prompt length, max_tokens), greedy, so every level sends the same requests.

    python benchmarks/serve_load.py [--ckpt DIR | --preset small] [--dtype bfloat16] [--tp-world 1]
        [--clients 1,8] [--requests-per-client 4] [--reps 1] [--max-seconds 300] [--max-running 8] [--json F]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from common import Parser, alternate, checkpoint_dir, int_list, positive_float, positive_int, script

from pocketllm.model_args import check_out_path
from pocketllm.out_file import write_json

# (prompt tokens, max_tokens): short chat-sized prompts, answers long enough that decode dominates.
MIX = [(32, 96), (128, 64), (64, 128), (256, 64), (16, 96), (96, 128), (48, 64), (192, 96)]
# Prompt ids cycle through printable bytes, which every checkpoint make-checkpoint writes can show.
PROMPT_IDS = list(range(32, 127))
REQUEST_TIMEOUT_S = 300


@dataclass
class Record:
    sent: float
    token_times: list[float] = field(default_factory=list)
    ended: float | None = None
    error: str | None = None


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", help="checkpoint with tokenizer.json (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp-world", type=positive_int, default=1)
    p.add_argument("--max-running", type=positive_int, default=8)
    p.add_argument("--clients", type=int_list(1), default=[1, 8], help="client counts, one level each (default 1,8)")
    p.add_argument("--requests-per-client", type=positive_int, default=4)
    p.add_argument("--reps", type=positive_int, default=1, help="runs of every level, interleaved (default 1)")
    p.add_argument("--max-seconds", type=positive_float, default=300, help="per level: no request starts after this (default 300)")
    p.add_argument("--json", help="write the settings and every level's figures here")
    args = p.parse_args(argv)
    # Before the run, not after it: a path that cannot be written would lose every figure.
    check_out_path(args.json, "--json", args.ckpt)
    return args


def start_server(args, ckpt: str, max_len: int | None = None, extra: list[str] = (), env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """`pocketllm serve` on a port the system picks, once it listens: the process, HOST:PORT and
    its stderr lines so far (more are appended as they come). `max_len` defaults to what the mix
    needs; `extra` are more serve flags, `env` variables set over this process's environment."""
    max_len = max_len or max(p + n for p, n in MIX)
    cmd = [sys.executable, "-m", "pocketllm", "serve", "--ckpt", ckpt, "--dtype", args.dtype, "--tp-world", str(args.tp_world),
           "--port", "0", "--max-running", str(args.max_running), "--max-len", str(max_len), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})})
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"serving \S+ on http://([\d.]+):(\d+)", line):
            # Kept on the process: stop_server waits for it, so the closing lines are in `lines`.
            proc.stderr_reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
            proc.stderr_reader.start()
            return proc, f"{m.group(1)}:{m.group(2)}", lines
    raise SystemExit("the server did not start:\n" + "".join(lines))


def stop_server(proc: subprocess.Popen, grace_s: float = 15) -> int | str:
    """SIGINT, then its exit status, or a note that it had to be killed after `grace_s`; its stderr
    read to the end (start_server's lines hold all of it)."""
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = f"killed after {grace_s:g} s"
    reader = getattr(proc, "stderr_reader", None)
    if reader is not None:
        reader.join(5)
    return rc


def model_name(addr: str) -> str:
    host, port = addr.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def one_request(addr: str, model: str, index: int) -> Record:
    prompt_len, max_tokens = MIX[index % len(MIX)]
    prompt = [PROMPT_IDS[(index + i) % len(PROMPT_IDS)] for i in range(prompt_len)]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "return_token_ids": True}).encode()
    host, port = addr.split(":")
    rec = Record(time.perf_counter())
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            rec.error = f"HTTP {r.status}: {r.read()[:200]!r}"
            return rec
        finish = None
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                rec.error = chunk["error"]["message"]
                return rec
            now = time.perf_counter()
            choice = chunk["choices"][0]
            rec.token_times += [now] * len(choice.get("token_ids", []))
            finish = choice.get("finish_reason") or finish
        rec.ended = time.perf_counter()
        if finish is None:
            rec.error = "the stream ended without a finish reason"
        elif len(rec.token_times) != max_tokens and finish == "length":
            rec.error = f"{len(rec.token_times)} tokens for max_tokens={max_tokens}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return rec


def run_level(addr: str, model: str, clients: int, per_client: int, max_seconds: float) -> dict:
    records: list[Record] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def client(c: int) -> None:
        for k in range(per_client):
            if time.perf_counter() - t0 > max_seconds:
                return
            rec = one_request(addr, model, c * per_client + k)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in records if r.error is None]
    tokens = sum(len(r.token_times) for r in ok)
    ttft = [r.token_times[0] - r.sent for r in ok if r.token_times]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    return {
        "clients": clients,
        "requests_planned": clients * per_client,
        "requests_done": len(ok),
        "requests_failed": [r.error for r in records if r.error is not None],
        "requests_not_started": clients * per_client - len(records),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        # Each request: when it was sent (from the level's start), its first token, its last
        # token and its end, in ms from when it was sent, and its token count.
        "requests": [
            {"sent_ms": round((r.sent - t0) * 1e3, 1), "tokens": len(r.token_times),
             "first_ms": round((r.token_times[0] - r.sent) * 1e3, 1) if r.token_times else None,
             "last_ms": round((r.token_times[-1] - r.sent) * 1e3, 1) if r.token_times else None,
             "end_ms": round((r.ended - r.sent) * 1e3, 1) if r.ended else None, "error": r.error}
            for r in sorted(records, key=lambda r: r.sent)
        ],
    }


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"p50": round(q[49] * 1e3, 1), "p90": round(q[89] * 1e3, 1), "p99": round(q[98] * 1e3, 1)}


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    levels = args.clients
    ckpt = checkpoint_dir(argparse.Namespace(ckpt=args.ckpt, preset=args.preset, dtype=args.dtype))
    proc, addr, server_lines = start_server(args, ckpt)
    try:
        model = model_name(addr)
        warm = one_request(addr, model, 0)
        if warm.error:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        results = []
        for rep in range(args.reps):
            for clients in alternate(levels, rep):
                res = run_level(addr, model, clients, args.requests_per_client, args.max_seconds)
                res["rep"] = rep
                res["load_average_1m"] = os.getloadavg()[0]
                results.append(res)
                print(
                    f"rep={rep} clients={clients} requests={res['requests_done']}/{res['requests_planned']} failed={len(res['requests_failed'])} "
                    f"requests_per_s={res['requests_per_s']} output_tok_per_s={res['output_tokens_per_s']} "
                    f"ttft_ms p50/p90/p99={'/'.join(str(v) for v in res['ttft_ms'].values())} "
                    f"itl_ms p50/p90/p99={'/'.join(str(v) for v in res['itl_ms'].values())} "
                    f"load_average_1m={res['load_average_1m']:.2f}",
                    flush=True,
                )
    finally:
        rc = stop_server(proc)
    summary = {}
    for clients in levels:
        mine = [r for r in results if r["clients"] == clients]
        if mine:
            summary[clients] = {k: statistics.median(r[k] for r in mine) for k in ("requests_per_s", "output_tokens_per_s")}
            print(f"clients={clients} median of {len(mine)}: requests_per_s={summary[clients]['requests_per_s']:.3f} "
                  f"output_tok_per_s={summary[clients]['output_tokens_per_s']:.1f}")
    if len(summary) > 1 and summary[levels[0]]["output_tokens_per_s"] > 0:
        base = summary[levels[0]]["output_tokens_per_s"]
        for clients in levels[1:]:
            print(f"clients={clients} vs clients={levels[0]}: {summary[clients]['output_tokens_per_s'] / base:.2f}x output tok/s (medians)")
    print(f"server exit status: {rc}")
    settings = {"preset": None if args.ckpt else args.preset, "ckpt": args.ckpt, "dtype": args.dtype, "tp_world": args.tp_world,
                "max_running": args.max_running, "mix": MIX, "requests_per_client": args.requests_per_client,
                "machine": f"{platform.machine()} {os.cpu_count()} cores", "server_log": "".join(server_lines[-5:])}
    if args.json:
        write_json(args.json, "--json", {"settings": settings, "levels": results, "medians": summary})
    lost = any(r["requests_failed"] or r["requests_not_started"] for r in results)
    return 1 if lost or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())

"""`pocketllm serve` against vLLM's `vllm serve` on the same checkpoint, both driven by vLLM's own
load generator (`vllm bench serve`): output tokens/s, time to first token and time per output
token, p50 and p99, for a random dataset and a shared-prefix one, with the ratios.

vLLM's CPU build is the peer, a measuring tool only (../shared/peers/vllm-cpu/setup.sh installs
it; --vllm or VLLM_CPU_PEER_DIR says where). The servers run one after the other, never both at
once: each rep starts every server in turn (the order reversed every other rep), runs each
dataset's `vllm bench serve` against it (the same command for both, its --save-result JSON read
back), and stops it. Prefix caching is on in both (pocketllm's default; vLLM is given
--enable-prefix-caching). `--pocketllm NAME=FLAGS` (repeatable) adds pocketllm servers with other
serve flags, all in the same interleaved run, to compare settings against the same vLLM figures.
Each pocketllm line adds its prefix cache's hits, misses and positions not run in that dataset.

--results FILE keeps every rep: a run adds its reps to what FILE holds (continuing the order's
alternation) and summarizes them all, so a long comparison can run in short windows.

    python benchmarks/vs_vllm.py --ckpt DIR [--vllm PATH] [--reps 2] [--datasets random,prefix_repetition]
        [--num-prompts 32] [--max-concurrency 8] [--pocketllm NAME=FLAGS ...] [--results FILE]
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import Parser, alternate, positive_int, script, spread
from serve_load import start_server, stop_server

from pocketllm.errors import UsageError
from pocketllm.model_args import check_out_path
from pocketllm.out_file import write_json
from pocketllm.serving.metrics import parse

SERVED_NAME = "bench"
MAX_LEN = 4096
PEER_DIR = Path(os.environ.get("VLLM_CPU_PEER_DIR", Path.home() / ".cache/pocketllm-peers/vllm-cpu"))
# The figures read from the client's result JSON (--metric-percentiles 50,99).
METRICS = {
    "output tok/s": "output_throughput",
    "TTFT p50 ms": "p50_ttft_ms",
    "TTFT p99 ms": "p99_ttft_ms",
    "TPOT p50 ms": "p50_tpot_ms",
    "TPOT p99 ms": "p99_tpot_ms",
}
START_TIMEOUT_S = 600


def dataset_flags(args) -> dict[str, list[str]]:
    return {
        "random": ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)],
        "prefix_repetition": [
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
        ],
    }


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", required=True, help="HF checkpoint with tokenizer.json, served by both")
    p.add_argument("--vllm", default=str(PEER_DIR / "vllm"), help=f"the vllm command (default {PEER_DIR}/vllm, VLLM_CPU_PEER_DIR)")
    p.add_argument("--reps", type=positive_int, default=2, help="rep pairs to run now (default 2)")
    p.add_argument("--datasets", default="random,prefix_repetition", help="of random, prefix_repetition (default both)")
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--max-concurrency", type=positive_int, default=8)
    p.add_argument("--input-len", type=positive_int, default=256, help="random: prompt tokens (default 256)")
    p.add_argument("--output-len", type=positive_int, default=64, help="output tokens, both datasets (default 64)")
    p.add_argument("--prefix-len", type=positive_int, default=256, help="prefix_repetition: shared prefix tokens (default 256)")
    p.add_argument("--suffix-len", type=positive_int, default=256, help="prefix_repetition: tokens after it (default 256)")
    p.add_argument("--num-prefixes", type=positive_int, default=4, help="prefix_repetition: distinct prefixes (default 4)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-running", type=positive_int, default=8, help="pocketllm --max-running (default 8)")
    p.add_argument("--pocketllm", action="append", metavar="NAME=FLAGS",
                   help="a pocketllm server with these extra serve flags (repeatable; default one, 'pocketllm', with none)")
    p.add_argument("--vllm-args", default="--enforce-eager", help="extra vllm serve flags (default --enforce-eager)")
    p.add_argument("--vllm-kv-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    p.add_argument("--servers", default=None, help="run only these of the servers' names (default all)")
    p.add_argument("--results", help="JSON file of reps: read, extended with this run's, written back")
    args = p.parse_args(argv)
    # Before any server starts: a rep takes minutes, and its figures go there.
    check_out_path(args.results, "--results", args.ckpt)
    args.datasets = args.datasets.split(",")
    bad = [d for d in args.datasets if d not in dataset_flags(args)]
    if bad:
        p.error(f"--datasets: unknown {', '.join(bad)}; known: random, prefix_repetition")
    variants = {}
    for spec in args.pocketllm or ["pocketllm="]:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name == "vllm":
            p.error(f"--pocketllm takes NAME=FLAGS with a name other than vllm, got {spec!r}")
        variants[name] = shlex.split(flags)
    args.variants = variants
    args.tp_world = 1
    return args


def check_peer(path: str) -> None:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SystemExit(
            f"vLLM's CPU build is not installed at {path}: ../shared/peers/vllm-cpu/setup.sh installs it "
            "(or give --vllm PATH, or set VLLM_CPU_PEER_DIR); it is a measuring tool, never needed by pocketllm"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(args, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": args.vllm_kv_gib, "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    cmd = [args.vllm, "serve", args.ckpt, "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args.dtype, "--max-model-len", str(MAX_LEN), "--enable-prefix-caching", *shlex.split(args.vllm_args)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited with status {proc.returncode} before listening; its log: {log.name}")
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, addr
        except OSError:
            time.sleep(1)
    stop_server(proc)
    raise SystemExit(f"vllm serve did not answer /health within {START_TIMEOUT_S} s; its log: {log.name}")


def start_pocketllm(args, flags: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    return start_server(args, args.ckpt, MAX_LEN, ["--served-model-name", SERVED_NAME, *flags])


def bench(args, addr: str, dataset: str) -> dict:
    """One `vllm bench serve` run against addr: the figures of its result JSON."""
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as tmp:
        cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", f"http://{addr}", "--model", SERVED_NAME,
               "--tokenizer", args.ckpt, *dataset_flags(args)[dataset], "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        path = Path(tmp) / "result.json"
        if r.returncode != 0 or not path.exists():
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            raise SystemExit(f"vllm bench serve failed (exit {r.returncode}) against {addr}:\n{tail}")
        res = json.loads(path.read_text())
    out = {name: res[key] for name, key in METRICS.items()}
    out.update(completed=res["completed"], failed=res["failed"], output_tokens=res["total_output_tokens"], duration_s=res["duration"])
    return out


def prefix_counts(addr: str) -> dict[str, float]:
    """pocketllm's prefix cache counters from /metrics (hits and misses are requests, hit tokens
    the prompt positions not run), so a dataset's own are the difference around its run."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        metrics = parse(r.read().decode())
    return {
        name.removeprefix("pocketllm_prefix_cache_").removesuffix("_total"): value
        for name, value in metrics.items()
        if name.startswith("pocketllm_prefix_cache_") and name.endswith("_total")
    }


def run_rep(args, rep: int, servers: list[str], log_dir: str) -> list[dict]:
    rows = []
    for server in alternate(servers, rep):
        with open(f"{log_dir}/{server}-rep{rep}.log", "w") as log:
            t0 = time.perf_counter()
            lines: list[str] = []
            if server == "vllm":
                proc, addr = start_vllm(args, log)
            else:
                proc, addr, lines = start_pocketllm(args, args.variants[server])
            started = time.perf_counter() - t0
            try:
                for dataset in args.datasets:
                    before = None if server == "vllm" else prefix_counts(addr)
                    res = bench(args, addr, dataset)
                    res.update(rep=rep, server=server, dataset=dataset, start_s=round(started, 1), load_average_1m=os.getloadavg()[0])
                    hits = ""
                    if before is not None:
                        after = prefix_counts(addr)
                        res["prefix_cache"] = {k: after[k] - before.get(k, 0) for k in after}
                        hits = " prefix cache: " + " ".join(f"{k}={v:g}" for k, v in res["prefix_cache"].items())
                    rows.append(res)
                    print(f"rep={rep} {server:>10} {dataset:>17}: " + " ".join(f"{k}={res[k]:.1f}" for k in METRICS)
                          + f" completed={res['completed']} failed={res['failed']}{hits}", flush=True)
            finally:
                rc = stop_server(proc, grace_s=30)
                # pocketllm's stderr, its closing lines (where the engine's time went) included.
                log.writelines(lines)
                if rc != 0:
                    print(f"  {server} exit status: {rc} (log {log.name})", flush=True)
    return rows


def summarize(rows: list[dict], servers: list[str], datasets: list[str]) -> dict:
    """Medians (min..max) per server and dataset, and each pocketllm server's ratio of medians to vLLM's."""
    summary = {}
    for dataset in datasets:
        print(f"\n{dataset}: median (min..max) over reps")
        print(f"{'':>10} " + " ".join(f"{k:>24}" for k in METRICS) + "  failed")
        med = {}
        for server in servers:
            mine = [r for r in rows if r["server"] == server and r["dataset"] == dataset]
            if not mine:
                continue
            med[server] = {k: statistics.median(r[k] for r in mine) for k in METRICS}
            print(f"{server:>10} " + " ".join(f"{spread([r[k] for r in mine]):>24}" for k in METRICS)
                  + f"  {sum(r['failed'] for r in mine)} of {sum(r['completed'] + r['failed'] for r in mine)} (reps {len(mine)})")
        for server in med:
            if server != "vllm" and "vllm" in med:
                ratios = {k: med[server][k] / med["vllm"][k] for k in METRICS}
                print(f"{server + '/vllm':>10} " + " ".join(f"{ratios[k]:>23.2f}x" for k in METRICS))
                med[server]["ratio_to_vllm"] = ratios
        summary[dataset] = med
    return summary


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    servers = ["vllm", *args.variants]
    if args.servers:
        wanted = args.servers.split(",")
        unknown = [s for s in wanted if s not in servers]
        if unknown:
            raise SystemExit(f"--servers: unknown {', '.join(unknown)}; these run: {', '.join(servers)}")
        servers = [s for s in servers if s in wanted]
    check_peer(args.vllm)  # its client drives pocketllm too
    if not (Path(args.ckpt) / "tokenizer.json").exists():
        raise SystemExit(f"--ckpt {args.ckpt}: no tokenizer.json (write the checkpoint with `pocketllm make-checkpoint`)")
    previous = []
    if args.results and Path(args.results).exists():
        try:
            previous = json.loads(Path(args.results).read_text())["reps"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--results {args.results}: not a results file of this script ({type(exc).__name__}: {exc}); give another path") from None
    first = 1 + max((r["rep"] for r in previous), default=-1)
    log_dir = tempfile.mkdtemp(prefix="vs-vllm-logs-")
    print(f"machine: {platform.machine()} {os.cpu_count()} cores; servers {', '.join(servers)}; datasets {', '.join(args.datasets)}; "
          f"reps {first}..{first + args.reps - 1}; server logs in {log_dir}", flush=True)
    rows = list(previous)
    for rep in range(first, first + args.reps):
        rows += run_rep(args, rep, servers, log_dir)
        if args.results:
            write_json(args.results, "--results", {"settings": settings(args), "reps": rows})
    summary = summarize(rows, list(dict.fromkeys([*servers, *(r["server"] for r in rows)])), args.datasets)
    print(json.dumps({"settings": settings(args), "summary": summary}))
    return 1 if any(r["failed"] for r in rows) else 0


def settings(args) -> dict:
    return {"ckpt": args.ckpt, "dtype": args.dtype, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
            "input_len": args.input_len, "output_len": args.output_len, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
            "num_prefixes": args.num_prefixes, "max_running": args.max_running, "pocketllm": args.variants, "vllm_args": args.vllm_args,
            "machine": f"{platform.machine()} {os.cpu_count()} cores"}


if __name__ == "__main__":
    sys.exit(main())

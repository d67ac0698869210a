"""`pocketllm serve`: an OpenAI-compatible HTTP server (pocketllm.serving). Rank 0 steps the
scheduler and starts the HTTP server as a process of its own, linked to it by a socket pair; every
other rank follows the passes rank 0 runs."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass, fields

from pocketllm import rank_failures
from pocketllm.commands.ranked import run_with_model
from pocketllm.commands.settings import model_run_plan
from pocketllm.engine.budgets import DEFAULT_KV_FRACTION, DEFAULT_PREFILL_BUDGET, PREFIX_CACHE_FRACTION
from pocketllm.errors import UsageError
from pocketllm.generation_config import FILE as GENERATION_FILE
from pocketllm.generation_config import GenerationConfig, read_generation_config
from pocketllm.inputs import load_tokenizer
from pocketllm.layers.kv_layout import KV_BLOCK_SIZE, blocks_for, gdn_slot_bytes, kv_block_bytes
from pocketllm.model_args import add_model_args, say
from pocketllm.run_plan import RunPlan
from pocketllm.switches import env_value
from pocketllm.topology import meminfo_bytes

# The longest sequence a slot holds unless --max-len says otherwise, below the model's own limit:
# the scheduler keeps room for --max-running sequences of this length.
DEFAULT_MAX_LEN = 8192
# After a launcher passed rank 0 a stop, the most the ranks get to end the run themselves: open
# requests answered, the engine closed.
STOP_GRACE_S = 8.0
ENV_API_KEY = "POCKETLLM_API_KEY"
SERVE_EXTRA = "pip install -e '.[serve]'"


def add_arguments(p) -> None:
    add_model_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 exposes it)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 lets the system pick, printed at start)")
    s.add_argument("--max-running", type=int, default=8, help="requests generated at once (default 8); more wait their turn")
    s.add_argument("--max-len", type=int, help=f"longest prompt plus completion, in tokens (default {DEFAULT_MAX_LEN}, or the model's limit if lower)")
    s.add_argument(
        "--prefill-budget",
        type=int,
        default=DEFAULT_PREFILL_BUDGET,
        help=f"prompt tokens one pass may read, all requests together, beside one decode row per running request (default "
        f"{DEFAULT_PREFILL_BUDGET}); a longer prompt is read over several passes. Lower: running requests' tokens wait less "
        "behind new prompts (time per output token), each prompt waits longer for its first token",
    )
    s.add_argument(
        "--kv-cache-gib",
        type=float,
        help=f"KV cache pool per rank, in GiB, taken by requests as they grow (default {DEFAULT_KV_FRACTION:g} of the memory free "
        "after loading, shared by the host's ranks on a CPU; never more than --max-running sequences of --max-len fill)",
    )
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start a request from the longest cached prefix of its tokens (where a prompt's chunk ended; where an earlier "
        "request stopped too where the run is not batch-invariant: a GPU's or NPU's default, or POCKETLLM_BATCH_INVARIANT=0): KV blocks shared, "
        f"Gated DeltaNet state copied, up to {PREFIX_CACHE_FRACTION:g} of the KV cache's budget "
        "in copies, made as prefixes are cached (default on)",
    )
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request (default: env POCKETLLM_API_KEY, which keeps "
                   "the key out of the process list; unset: no authentication)")
    s.add_argument("--allowed-origins", default="",
                   help="origins whose web pages may call this server (CORS), comma-separated (https://app.example,http://localhost:3000), "
                   "or * for any (default: none, so a browser refuses a page of another origin the answers)")
    s.add_argument("--served-model-name", help="the model name clients send (default: the checkpoint directory's name)")
    s.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto (default): the sampling fields of the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty) are the defaults of a request that leaves them out, as vLLM's server does; none: the API's own "
        "defaults. Its eos ids end answers either way",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=("qwen3",),
        help="qwen3: a chat answer's reasoning (up to </think>) comes back as the message's `reasoning` (and `reasoning_content`, "
        "its older name), the rest as its content, as vLLM's --reasoning-parser qwen3 returns them (default: all of it is content)",
    )


@dataclass(frozen=True)
class Task:
    """serve's own settings in the run plan."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_running: int = 8
    max_len: int | None = None
    prefill_budget: int = DEFAULT_PREFILL_BUDGET
    kv_cache_gib: float | None = None
    enable_prefix_caching: bool = True
    api_key: str | None = None
    served_model_name: str | None = None
    generation_config: str = "auto"
    reasoning_parser: str | None = None
    allowed_origins: str = ""


def _prepare(run, plan) -> dict:
    t, ckpt = run.task, run.source.ckpt
    for module in ("fastapi", "uvicorn", "jinja2"):
        try:
            __import__(module)
        except ImportError:
            raise UsageError(f"serve needs {module}, which is not installed: {SERVE_EXTRA}") from None
    if ckpt is None:
        raise UsageError("serve needs a checkpoint with tokenizer.json (--ckpt DIR), and presets have none; "
                         "write one with `pocketllm make-checkpoint --preset small --out DIR`")
    load_tokenizer(ckpt, "serve", "write a checkpoint with `pocketllm make-checkpoint`, which adds one")
    from pocketllm.serving.chat_template import load_chat_template

    if load_chat_template(ckpt) is None:
        # Said at start, not only to the first chat request's client.
        print("pocketllm: note: the checkpoint has no chat template (tokenizer_config.json or chat_template.jinja): "
              "/v1/chat/completions answers 404 no_chat_template; /v1/completions serves", file=sys.stderr, flush=True)
    if not 0 <= t.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {t.port}")
    if t.max_running < 1:
        raise UsageError(f"--max-running must be >= 1, got {t.max_running}")
    if t.prefill_budget < 1:
        raise UsageError(f"--prefill-budget must be >= 1, got {t.prefill_budget}")
    limit = plan.cfg.max_position_embeddings
    max_len = t.max_len if t.max_len is not None else min(DEFAULT_MAX_LEN, limit)
    if not 2 <= max_len <= limit:
        raise UsageError(f"--max-len must be in 2..{limit} (the model's max_position_embeddings), got {max_len}")
    _check_kv_budget(t, plan, run.world.size, max_len)
    if run.device.kind == "cpu":
        _check_host_memory(t, plan, run.world.size)
    if t.api_key is not None and not t.api_key.strip():
        raise UsageError(f"--api-key (or {ENV_API_KEY}) must not be empty")
    allowed_origins = origins(t.allowed_origins)
    _check_listen(t.host, t.port)
    from pathlib import Path

    name = t.served_model_name or Path(ckpt).resolve().name
    # A pass's rows are allocated at start: more than every slot's whole length is never read.
    budget = min(t.prefill_budget, t.max_running * max_len)
    return {"max_len": max_len, "model": name, "sampling_defaults": _sampling_defaults(t, ckpt, plan.cfg.vocab_size),
            "prefill_budget": budget, "allowed_origins": allowed_origins}


def _sampling_defaults(t: Task, ckpt: str, vocab: int) -> tuple:
    """The checkpoint's generation_config.json sampling fields (--generation-config auto), checked
    as a request's own would be."""
    if t.generation_config != "auto":
        return ()
    from pocketllm.serving.errors import ApiError
    from pocketllm.serving.protocol import check_sampling_defaults

    generation = read_generation_config(ckpt, vocab)
    try:
        check_sampling_defaults(dict(generation.sampling), vocab)
    except ApiError as exc:
        raise UsageError(f"{generation.path}: {exc.message} (--generation-config none leaves its sampling out)") from None
    return generation.sampling


def _check_kv_budget(t: Task, plan, world: int, max_len: int) -> None:
    """--kv-cache-gib must hold one sequence of --max-len, or some request could never finish."""
    if t.kv_cache_gib is None:
        return
    if not 0 < t.kv_cache_gib < float("inf"):
        raise UsageError(f"--kv-cache-gib must be a number > 0, got {t.kv_cache_gib}")
    per_block = kv_block_bytes(plan.cfg, world, plan.itemsize)
    need = blocks_for(max_len)
    if per_block and int(t.kv_cache_gib * 2**30) // per_block < need:
        raise UsageError(
            f"--kv-cache-gib {t.kv_cache_gib:g} holds fewer positions than one sequence of --max-len {max_len} "
            f"(at least {need * per_block / 2**30:.3g} GiB per rank here); raise it or lower --max-len"
        )


def _check_host_memory(t: Task, plan, world: int) -> None:
    """On a CPU the ranks of one host share its memory: the GDN state of --max-running + 1 slots
    and a --kv-cache-gib pool on every rank must fit in it (the pool is mapped lazily, so an
    oversized one would start, and meet the kernel's OOM killer under load)."""
    total = meminfo_bytes("MemTotal")
    if not total:
        return
    slots = (t.max_running + 1) * gdn_slot_bytes(plan.cfg, world, plan.itemsize)
    pool = int(t.kv_cache_gib * 2**30) if t.kv_cache_gib is not None else 0
    need = world * (slots + pool)
    if need > total:
        pool_said = f" and the KV pool (--kv-cache-gib {t.kv_cache_gib:g})" if pool else ""
        raise UsageError(f"the sequences' linear-attention state (--max-running {t.max_running}: {_size(slots)}){pool_said} "
                         f"per rank take {_size(need)} over {world} rank(s), more than this host's {_size(total)}; lower them")


def _size(nbytes: float) -> str:
    """Bytes as a person reads them: GiB from one up, MiB below (a tiny pool read 0.00 GiB)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _pool(engine, t: Task, max_len: int) -> tuple[int, int]:
    """The KV pool's blocks and the blocks its budget would hold uncapped, the same on every rank,
    and rank 0 says what the pool holds."""
    from pocketllm.distributed.state import tp
    from pocketllm.engine.slots import pool_blocks

    budget = pool_blocks(engine, t.kv_cache_gib)
    blocks = min(budget, t.max_running * blocks_for(max_len))
    per_block = kv_block_bytes(engine.cfg, tp().world, engine.dtype.itemsize)
    if blocks < blocks_for(max_len):
        raise RuntimeError(
            f"the default KV cache budget ({DEFAULT_KV_FRACTION:g} of the free memory) holds {blocks * KV_BLOCK_SIZE} positions, "
            f"fewer than one sequence of --max-len {max_len}: give --kv-cache-gib or lower --max-len"
        )
    say(
        f"KV cache: {blocks} blocks of {KV_BLOCK_SIZE} positions, {blocks * KV_BLOCK_SIZE} positions in all, "
        f"{_size(blocks * per_block)} per rank ({t.max_running} sequences of {max_len} would fill "
        f"{_size(t.max_running * blocks_for(max_len) * per_block)}); linear-attention state of {t.max_running + 1} slots "
        f"{_size((t.max_running + 1) * gdn_slot_bytes(engine.cfg, tp().world, engine.dtype.itemsize))} per rank"
    )
    return blocks, budget


def _prefix_cache_bytes(engine, t: Task, budget_blocks: int) -> int:
    """The prefix cache's budget for GDN state copies (0 when off), and rank 0 says what it holds:
    a fraction of the KV cache's budget (--kv-cache-gib or its default), not of the pool that
    --max-running sequences of --max-len cap, which for a small model holds a handful of copies
    (the copies are made as prefixes are cached, never up front)."""
    from pocketllm.engine.slots import prefix_cache_bytes

    if not t.enable_prefix_caching:
        say("prefix cache: off")
        return 0
    budget = prefix_cache_bytes(engine, t.kv_cache_gib, budget_blocks)
    entry = engine.slots.sequence_bytes()
    say(f"prefix cache: up to {budget // max(1, entry)} prefixes ({entry / 2**20:.2f} MiB of Gated DeltaNet state each, {budget / 2**20:.0f} MiB)")
    return budget


def _check_listen(host: str, port: int) -> None:
    """Fail before loading the model when the address cannot be listened on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: cannot resolve ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _work(run, plan, settings: dict, engine, device) -> int:
    # A rank's imports: the launcher imports this module to check, and never imports torch.
    from pocketllm.distributed.state import tp
    from pocketllm.engine.pass_plan import follow
    from pocketllm.engine.scheduler import Scheduler

    t, ckpt = run.task, run.source.ckpt
    kv_blocks, budget_blocks = _pool(engine, t, settings["max_len"])
    if tp().rank != 0:
        follow(engine, t.max_running, settings["max_len"], settings["prefill_budget"], kv_blocks=kv_blocks)
        return 0
    from pocketllm.serving.engine_driver import EngineDriver
    from pocketllm.serving.http_process import end_http, start_http, stop_on_signals

    cache_bytes = _prefix_cache_bytes(engine, t, budget_blocks)
    scheduler = Scheduler(
        engine, t.max_running, settings["max_len"], settings["prefill_budget"], kv_blocks=kv_blocks, prefix_cache_bytes=cache_bytes
    )
    if device.torch_device.type != "cpu" and tp().world == 1:
        # The device's kernels compiled before the first request, not on it (a CPU's are built
        # and measured at load; with several ranks the passes would have to be planned for all).
        engine.warm_up_shapes()
    # The HTTP side (routes, tokenizer, JSON) runs in a process of its own, so that it never holds
    # this process's GIL while a pass runs.
    defaults = settings["sampling_defaults"]
    if defaults:
        say(f"sampling defaults from {GENERATION_FILE}: {GenerationConfig(sampling=defaults).describe()} "
            "(a request's own fields win; --generation-config none for the API's defaults)")
    proc, link = start_http({
        "ckpt": ckpt, "host": t.host, "port": t.port, "model": settings["model"], "max_len": settings["max_len"],
        "vocab": plan.cfg.vocab_size, "eos_ids": tuple(plan.cfg.eos_token_ids), "api_key": t.api_key,
        "sampling_defaults": defaults, "reasoning_parser": t.reasoning_parser, "allowed_origins": settings["allowed_origins"],
    })
    driver = EngineDriver(scheduler, link)
    with stop_on_signals(driver.request_stop) as wake_fd:
        driver.wake_fd = wake_fd
        try:
            driver.run()
        finally:
            rc = end_http(proc, link)
    if driver.unusable is not None:
        raise UsageError(driver.unusable)
    if driver.lost:
        # The scheduler closed (every other rank's follow ended): one line, no traceback, the
        # same at any world size.
        return rank_failures.fail_with(f"the HTTP process ended before the server was stopped (exit status {rc})")
    say(driver.summary())
    say("server stopped")
    return 0


def origins(flag: str) -> tuple[str, ...]:
    """--allowed-origins as a list: each an origin (scheme://host[:port], no path) or *."""
    found = tuple(o.strip() for o in flag.split(",") if o.strip())
    for o in found:
        scheme, sep, rest = o.partition("://")
        if o != "*" and (not sep or scheme not in ("http", "https") or not rest or "/" in rest):
            raise UsageError(f"--allowed-origins: {o!r} is not an origin: give scheme://host[:port] (https://app.example), or *")
    return found


def run(args) -> int:
    api_key = args.api_key if args.api_key is not None else (env_value(os.environ, ENV_API_KEY) or None)
    # Every setting by its flag's name, so none is left out (--reasoning-parser was).
    task = Task(**{f.name: getattr(args, f.name) for f in fields(Task)} | {"api_key": api_key})
    return execute(model_run_plan(args, task))


def execute(run: RunPlan) -> int:
    return run_with_model(run, _prepare, _work, forward_signals=STOP_GRACE_S)

"""`pocketllm bench`: the seed's resident bench. Load once, warm up, then one timed prefill of the
prompt and one timed decode of --max-new-tokens; rank 0 prints the result line. With --batch B,
B sequences of the prompt's length: their prompts packed into one prefill pass, then decode steps
of one row per sequence. `pocketllm engine` (the `pocketllm_engine` script) is this command under
the seed's name, taking the seed's section 8 rank command as written (docs/seed.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pocketllm.commands.ranked import run_with_model
from pocketllm.commands.settings import model_run_plan, source_plan, tuple_or_none
from pocketllm.errors import UsageError
from pocketllm.flags import add_warmup_arg, check_warmup_tokens
from pocketllm.inputs import PromptSource, checked_bench_ids, prompt_ids
from pocketllm.model_args import add_model_args, check_out_path, say
from pocketllm.out_file import write_json
from pocketllm.profiling import kernel_profile
from pocketllm.run_plan import RunPlan
from pocketllm.startup import seconds_since_start


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, help="length of the deterministic prompt (default 512)")
    p.add_argument("--token-ids", action="append", help="use these ids as the prompt instead (once: --batch runs several sequences of it)")
    p.add_argument("--token-ids-file", help="read the prompt ids from this file instead")
    p.add_argument("--max-new-tokens", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument(
        "--batch", type=int, default=1, help="sequences run together (default 1); from 2, the prompt's ids are rotated by one per sequence"
    )
    add_warmup_arg(p)
    p.add_argument(
        "--limits", action=argparse.BooleanOptionalAction, default=None,
        help="measure the memory and matmul rates after the run and print each figure's share of the limit they set "
        "(default: on for a GPU or NPU, off on a CPU)",
    )
    p.add_argument(
        "--kernel-profile", action="store_true",
        help="after the timed run, one more prefill and the decode steps under torch.profiler: how busy the device was and "
        "the kernels (CUDA) or torch ops (CPU) that took most of its time (not on an NPU)",
    )
    p.add_argument("--json", help="also write the result and the run's settings to this file")
    seed = p.add_argument_group("the seed's rank command (docs/seed.md)")
    seed.add_argument("--resident-bench", action="store_true", help="the seed's mode flag for what this command always runs")
    seed.add_argument("--smoke-forward", action="store_true", help="the seed's flag for the forward passes this command always runs")
    seed.add_argument("--smoke-layers", type=int, metavar="N", help="run the first N layers, 0 for all (the seed's --layers)")


@dataclass(frozen=True)
class Task:
    """bench's own settings in the run plan."""

    prompt: PromptSource
    prompt_tokens: int = 512
    batch: int = 1
    warmup_tokens: int | None = None
    json: str | None = None
    limits: bool | None = None
    kernel_profile: bool = False


def seed_layers(args) -> int | None:
    """--layers, or --smoke-layers N standing for it (0: every layer)."""
    n = args.smoke_layers
    if n is None:
        return args.layers
    if n < 0:
        raise UsageError(f"--smoke-layers must be >= 0 (0 runs every layer), got {n}")
    layers = n or None
    if args.layers is not None and args.layers != layers:
        raise UsageError(f"--smoke-layers {n} and --layers {args.layers} disagree: give one")
    return layers


def _prepare(run, plan):
    t = run.task
    # Before the prompt's own checks, which take 0 new tokens (generate's --max-new-tokens may be 0).
    if t.prompt.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 for a bench, got {t.prompt.max_new_tokens}")
    ids = prompt_ids(t.prompt, plan.cfg, run.source.ckpt) or checked_bench_ids(t.prompt_tokens, plan.cfg, t.prompt.max_new_tokens)
    check_warmup_tokens(t.warmup_tokens)
    check_out_path(t.json, "--json", run.source.ckpt)
    if t.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {t.batch}")
    if t.kernel_profile and not kernel_profile.supported(run.device.kind):
        raise UsageError(f"--kernel-profile runs on a CPU or a CUDA device, not on {run.device.kind}")
    return ids


def format_result(r: dict) -> str:
    parts = [f"batch={r['batch']}"] if "batch" in r else []
    parts += [
        f"prefill_seconds={r['prefill_seconds']:.4f}",
        f"prefill_tokens={r['prefill_tokens']}",
        f"prefill_tokens_per_s={r['prefill_tokens_per_s']:.1f}",
        f"decode_seconds={r['decode_seconds']:.4f}",
        f"decode_tokens={r['decode_tokens']}",
        f"decode_tokens_per_s={r['decode_tokens_per_s']:.2f}",
        *([f"decode_tokens_per_s_per_sequence={r['decode_tokens_per_s_per_sequence']:.2f}"] if "batch" in r else []),
        f"slices={r['slices']}",
        f"collectives={r['collectives']}",
        *([f"decode_step={r['decode_step']}"] if "decode_step" in r else []),
    ]
    return " ".join(parts)


def _work(run, plan, ids, engine, device) -> int:
    # A rank's imports: the launcher imports this module to check, and never imports torch.
    from pocketllm.bench import limits
    from pocketllm.commands.on_rank import cpus_per_rank, peak_rss_mib_per_rank, per_rank, run_settings
    from pocketllm.distributed.state import group_pids, tp
    from pocketllm.engine.timing import timed_batch, timed_prefill_decode, warm_up, warm_up_batch
    from pocketllm.ops.registry.trust import Monitor

    t = run.task
    new_tokens = t.prompt.max_new_tokens
    prompts = [ids[i % len(ids) :] + ids[: i % len(ids)] for i in range(t.batch)]
    if t.batch == 1:
        warm_up(engine, ids, [len(ids)], device.synchronize, t.warmup_tokens)
    else:
        warm_up_batch(engine, prompts, device.synchronize, t.warmup_tokens)
    # Loaded and warmed up (kernels compiled, graphs captured): what a user waits before a first
    # token comes at full speed.
    ready = seconds_since_start()
    if ready is not None:
        say(f"ready {ready:.1f} s after the process started (loaded and warmed up)")
    # Other processes' CPU time while the figures were timed (this run's ranks' own not counted):
    # a figure taken on a busy machine is low by an unknown amount, and says so.
    monitor = Monitor(peers=group_pids())
    started = monitor.start()
    with engine.tagged(timed=True):
        if t.batch == 1:
            result = timed_prefill_decode(engine, ids, new_tokens, device.synchronize)
        else:
            result = timed_batch(engine, prompts, new_tokens, device.synchronize)
    load = monitor.stop(started)
    if load.known:
        result["machine_load"] = {"others_share": round(load.others, 3), "steal_share": round(load.steal, 3), "busy": load.disturbed}
        if load.disturbed:
            say(f"note: the machine was busy while the figures were timed ({load.describe()}): they are low by an unknown amount")
    if ready is not None:
        result["ready_seconds"] = ready
    profiled = _kernel_profile(engine, prompts, new_tokens, device) if t.kernel_profile else None
    shares = None
    if (t.limits if t.limits is not None else device.torch_device.type != "cpu") and tp().rank == 0:
        shares = limits.shares(limits.measure(device.torch_device, engine.dtype, device.synchronize), engine.model, result)
        say(limits.describe(shares))
    rss = peak_rss_mib_per_rank()
    load_peak = per_rank(engine.load_peak_mib)
    weights = per_rank(engine.loaded_bytes / 2**20)
    cpus = cpus_per_rank()
    if tp().rank == 0:
        print(format_result(result), flush=True)
        if t.json:
            settings = {
                **run_settings(run, plan, device),
                "policy": plan.policy.policy.describe(),
                "gdn_kernel": engine.model.gdn_kernel.name if engine.model.gdn_kernel else None,
                # With its reason: whether a device's decode rows run the Triton kernel, or why not.
                "gdn_kernel_line": engine.model.gdn_kernel.describe() if engine.model.gdn_kernel else None,
                "peak_rss_mib_per_rank": rss,
                "weights_mib_per_rank": weights,
                "load_peak_rss_over_baseline_mib_per_rank": load_peak,
                "cpus_per_rank": cpus,
                "weights": plan.cfg.weights.describe() if plan.cfg.weights is not None else "unquantized",
                "kernels": engine.kernels.to_json(),
                "decode_ops": engine.model.decode_ops.describe(),
                # What a device's pass runs between its GEMMs: the Triton kernels, or the torch forms and why.
                "device_ops": engine.model.decode_ops.device.describe(),
                "decode_step": engine.describe_step(),
            }
            extra = {**({"limits": shares} if shares else {}), **({"kernel_profile": profiled} if profiled else {})}
            write_json(t.json, "--json", {**result, **extra, "settings": settings})
    return 0


def _kernel_profile(engine, prompts: list[list[int]], new_tokens: int, device) -> dict:
    """The timed run's prefill and decode steps once more, each under torch.profiler; rank 0
    prints both tables. Returns them for --json."""
    from pocketllm.engine.timing import TimedRun

    kind = device.torch_device.type
    run = TimedRun(engine, prompts, new_tokens, device.synchronize)
    rows = f"{len(prompts)} x {len(prompts[0])}" if len(prompts) > 1 else f"{len(prompts[0])}"
    prefill = kernel_profile.table(f"prefill of {rows} tokens", *kernel_profile.profile(run.prefill, kind, device.synchronize))
    wall, events = kernel_profile.profile(lambda: run.decode(new_tokens), kind, device.synchronize)
    # What ran them: the step backend, or the layers (a phase or host profile sends them there).
    how = engine.describe_step() if run.decode_path == "direct" else "layer by layer"
    decode = kernel_profile.table(f"{new_tokens} decode steps, {how}", wall, events)
    run.close()
    for t in (prefill, decode):
        say("\n".join(kernel_profile.describe(t, kind)))
    return {"prefill": prefill.to_json(), "decode": decode.to_json()}


def run(args) -> int:
    if args.token_ids is not None and len(args.token_ids) > 1:
        # generate reads a repeated --token-ids as several prompts; a bench times one prompt.
        raise UsageError(f"--token-ids given {len(args.token_ids)} times: a bench times one prompt (--batch B runs B sequences of it)")
    prompt = PromptSource(token_ids=tuple_or_none(args.token_ids), token_ids_file=args.token_ids_file, max_new_tokens=args.max_new_tokens)
    given = "--token-ids" if args.token_ids is not None else "--token-ids-file" if args.token_ids_file is not None else None
    if given and args.prompt_tokens is not None:
        # The ids are the prompt: its length is theirs, and a --prompt-tokens beside them was dropped.
        raise UsageError(f"--prompt-tokens sizes the deterministic prompt, which {given} replaces: give one")
    prompt_tokens = args.prompt_tokens if args.prompt_tokens is not None else Task.prompt_tokens
    task = Task(prompt, prompt_tokens, args.batch, args.warmup_tokens, args.json, args.limits, args.kernel_profile)
    return execute(model_run_plan(args, task, source=source_plan(args, seed_layers(args), "--layers" if args.smoke_layers is None else "--smoke-layers")))


def execute(run: RunPlan) -> int:
    return run_with_model(run, _prepare, _work)

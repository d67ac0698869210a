"""Settings read from the environment: the one list of every variable pocketllm reads, how they
are read, and the check at start that no set POCKETLLM_* or QWEN_* variable goes unread.

Every variable is named POCKETLLM_*; the seed's names are read as aliases (ALIASES), so commands
written for the seed keep working. On/off settings take 1/true/yes/on or 0/false/no/off, anything
else a usage error that names the variable. A reader names its variable through env_setting,
env_value or env_switch, which refuse a name missing from the list, and tests/test_env_names.py
checks every POCKETLLM_* name in the package is listed, so the list and the readers cannot drift."""

from __future__ import annotations

import difflib

from pocketllm.errors import UsageError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")

# Every variable a user may set: name -> what it sets (docs/seed.md and each reader's docs say more).
SETTINGS = {
    "POCKETLLM_COMM_OVERLAP_SLICES": "the slice rule's ceiling (--comm-overlap-slices)",
    "POCKETLLM_PIN_SLICES": "a slice count pinned at every site (--pin-slices)",
    "POCKETLLM_CALIBRATION": "a calibration file for the calibrated slice policy (--calibration)",
    "POCKETLLM_GDN_KERNEL": "force a gated delta rule kernel: chunk, recurrent, fla or npu",
    "POCKETLLM_PHASE_PROFILE": "1: the device-synced phase profile (--phase-profile)",
    "POCKETLLM_HOST_PROFILE": "1: the host wall-clock profile (--host-profile)",
    "POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS": "10 ms waits a hand-started rank makes for its peers",
    "POCKETLLM_COLLECTIVE": "the TP all-reduce: auto, shm or gloo (--collective)",
    "POCKETLLM_POLL_COLLECTIVES": "0: gloo ranks block in a collective instead of polling",
    "POCKETLLM_PIN_CPUS": "0: leave the ranks the launcher starts unpinned",
    "POCKETLLM_CPUS": "the cores of the ranks the launcher starts (--cpus)",
    "POCKETLLM_KERNELS": "force projection kernels, kind=name,...: one-row=c-ahead,int8-one-row=c (docs/decode.md)",
    "POCKETLLM_FUSED_DECODE": "0: decode with the torch forms of the fused ops (on a GPU, pocketllm's device ops in prefill too; fla's kernels and the GDN decode rows' kernel still run)",
    "POCKETLLM_COMPILED_STEP": "0: run a decode step of one sequence layer by layer, not as one compiled call",
    "POCKETLLM_CUDA_GRAPH": "0: run decode steps on CUDA layer by layer, not as captured CUDA graphs; 1 at TP>1: capture them with their all-reduces",
    "POCKETLLM_BF16_LAYOUT": "how bf16 projection weights are held on a CPU: auto (measured at start), rows or panels",
    "POCKETLLM_BATCH_INVARIANT": "0: faster kernels and passes, under which a request's tokens may depend on what runs beside it "
    "(on a CPU; on a device off unless 1)",
    "POCKETLLM_KEEP_FREED": "0: leave glibc's malloc settings as they are",
    "POCKETLLM_CACHE_DIR": "where compiled kernels and measured choices are kept",
    "POCKETLLM_API_KEY": "the API key serve requires (--api-key), out of the command line that every user can list",
    "POCKETLLM_ISA": "build the compiled kernels for at most this x86 set: native (the default), avx512f, avx2 or scalar",
    "POCKETLLM_FAULT": "inject a fault into one rank (tests and benchmarks/fault_timing.py)",
}

# Set by the launcher for the ranks it starts, never by a user; read by the ranks.
INTERNAL = {
    "POCKETLLM_LAUNCH_RANK": "this rank's number",
    "POCKETLLM_LAUNCH_WORLD": "the number of ranks",
    "POCKETLLM_LAUNCH_RDZV": "the launcher's private FileStore",
    "POCKETLLM_LAUNCH_REPORT": "where this rank leaves its one-line failure report",
    "POCKETLLM_RANK_CPUS": "the cores the launcher pinned this rank to",
    "POCKETLLM_LAUNCH_PIN_MAP": "the pinning map, for rank 0 to print",
    "POCKETLLM_LAUNCH_PLAN": "the run plan every rank runs on (pocketllm/run_plan.py)",
    "POCKETLLM_LAUNCH_CHECKED": "the inputs the launcher checked (the model plan and the command's), for rank 0 to share",
}

# The seed's names, read only when the POCKETLLM_* name is unset or empty: the new name wins.
ALIASES = {
    "POCKETLLM_COMM_OVERLAP_SLICES": "QWEN_COMM_OVERLAP_SLICES",
    "POCKETLLM_GDN_KERNEL": "QWEN_GDN_KERNEL",
    "POCKETLLM_PHASE_PROFILE": "QWEN_PHASE_PROFILE",
    "POCKETLLM_HOST_PROFILE": "QWEN_HOST_PROFILE",
    "POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS": "POCKETLLM_CPP_NCCL_ID_WAIT_ATTEMPTS",
}

# The variables that each forced one kind of kernel, now entries of POCKETLLM_KERNELS: name -> its
# kind there. One that is set is a usage error giving its new spelling wherever kernels are forced
# (refuse_renamed): running on without it would time or test other kernels than the ones asked for.
RENAMED = {
    "POCKETLLM_GEMV": "one-row", "POCKETLLM_FEW_ROWS": "few-row", "POCKETLLM_GEMM": "many-row",
    "POCKETLLM_INT8_GEMV": "int8-one-row", "POCKETLLM_INT8_FEW_ROWS": "int8-few-row", "POCKETLLM_INT8_GEMM": "int8-many-row",
    "POCKETLLM_INT4_GEMV": "int4-one-row", "POCKETLLM_INT4_FEW_ROWS": "int4-few-row", "POCKETLLM_INT4_GEMM": "int4-many-row",
}

PREFIXES = ("POCKETLLM_", "QWEN_")

# kind=name,...: the kernel each named kind runs, instead of the measured choice
# (pocketllm.ops.registry.forced_kernels).
ENV_KERNELS = "POCKETLLM_KERNELS"
# On (the default): a request's tokens do not depend on what else is batched with it
# (pocketllm.ops.registry.batch_invariant).
ENV_INVARIANT = "POCKETLLM_BATCH_INVARIANT"
# How bf16 weights are held on a CPU (pocketllm.ops.registry.layout), and what it may be set to.
ENV_BF16_LAYOUT = "POCKETLLM_BF16_LAYOUT"
BF16_LAYOUTS = ("auto", "rows", "panels")


def bf16_layout(env) -> str:
    """POCKETLLM_BF16_LAYOUT read and checked (auto where unset): a value it cannot take is a
    one-line usage error."""
    value = env.get(ENV_BF16_LAYOUT, "").strip() or "auto"
    if value not in BF16_LAYOUTS:
        raise UsageError(f"{ENV_BF16_LAYOUT}={value!r}: use {', '.join(BF16_LAYOUTS)}")
    return value


def forces_kernels(env) -> bool:
    """Whether any variable the registry's check of forced kernels reads is set (POCKETLLM_KERNELS,
    POCKETLLM_BATCH_INVARIANT, a RENAMED one): where none is, that check has nothing to refuse, so
    a launcher need not import the registry, which holds the kernels (and torch)."""
    return any(env.get(name, "").strip() for name in (ENV_KERNELS, ENV_INVARIANT, *RENAMED))


def env_setting(env, name: str) -> tuple[str, str]:
    """(the variable the setting was read from, its value, "" when unset), so that an error can
    name the variable the user actually set."""
    if name not in SETTINGS and name not in INTERNAL:
        raise KeyError(f"{name} is not in pocketllm.switches.SETTINGS")
    value = env.get(name, "")
    alias = ALIASES.get(name)
    if not value.strip() and alias is not None and env.get(alias, "").strip():
        return alias, env[alias]
    return name, value


def env_value(env, name: str) -> str:
    """The setting's value ("" when unset), from its alias when only that is set."""
    return env_setting(env, name)[1]


def env_switch(env, name: str, default: bool = False) -> bool:
    used, raw = env_setting(env, name)
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise UsageError(f"{used}={raw!r} is not a switch: use 1 (on) or 0 (off)")


def refuse_renamed(env) -> None:
    """A usage error naming every set variable of RENAMED and the one setting that says it now
    (POCKETLLM_GEMV=c and POCKETLLM_GEMM=mm are now POCKETLLM_KERNELS=one-row=c,many-row=mm)."""
    old = [(name, env[name].strip()) for name in RENAMED if env.get(name, "").strip()]
    if old:
        was = " and ".join(f"{name}={value}" for name, value in old)
        now = ",".join(f"{RENAMED[name]}={value}" for name, value in old)
        raise UsageError(f"{was} {'is' if len(old) == 1 else 'are'} now POCKETLLM_KERNELS={now}")


def nearest_name(name: str, offered: list[str]) -> str:
    """The offered name a mistyped one most likely meant: the longest that it extends or that
    extends it at a word boundary (POCKETLLM_CPUS_KERNEL -> POCKETLLM_CPUS, not the closer spelling
    POCKETLLM_KERNELS), else the closest spelling."""
    related = [o for o in offered if name.startswith(o + "_") or o.startswith(name + "_")]
    if related:
        return max(related, key=len)
    return difflib.get_close_matches(name, offered, n=1, cutoff=0.0)[0]


# The settings that are a switch (1 or 0): their value is checked at start wherever they are set,
# not only by a run that reads them (POCKETLLM_CUDA_GRAPH=x on a CPU ran on), as the others are
# where they are parsed.
SWITCHES = (
    "POCKETLLM_PHASE_PROFILE", "POCKETLLM_HOST_PROFILE", "POCKETLLM_POLL_COLLECTIVES", "POCKETLLM_PIN_CPUS", "POCKETLLM_FUSED_DECODE",
    "POCKETLLM_COMPILED_STEP", "POCKETLLM_CUDA_GRAPH", "POCKETLLM_BATCH_INVARIANT", "POCKETLLM_KEEP_FREED",
)


def check_switches(env) -> None:
    """A usage error naming the first switch (SWITCHES) set to something other than 1 or 0."""
    for name in SWITCHES:
        env_switch(env, name)


def environment_notes(env) -> list[str]:
    """One line per set POCKETLLM_* or QWEN_* variable that pocketllm does not read, naming the
    nearest name it does, and one per alias set beside its new name to another value, saying which
    is used. Printed once, at start, by the process that starts the run (pocketllm.cli)."""
    offered = [*SETTINGS, *ALIASES.values()]
    # A renamed variable is refused, with its new spelling, where it would have been read.
    known = {*offered, *INTERNAL, *RENAMED}
    lines = []
    for name in sorted(n for n in env if n.startswith(PREFIXES) and n not in known):
        nearest = nearest_name(name, offered)
        lines.append(f"pocketllm: warning: {name} is set but pocketllm reads no such variable, so it does nothing; the nearest it reads is {nearest}")
    for new, old in ALIASES.items():
        mine, seeds = env.get(new, "").strip(), env.get(old, "").strip()
        if mine and seeds and mine != seeds:
            lines.append(f"pocketllm: note: {new}={mine} and {old}={seeds} are both set; using {new}={mine}")
    return lines

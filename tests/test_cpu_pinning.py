"""The launcher pins each rank it starts to whole physical cores, all on one NUMA node where the
ranks fit per node, as sysfs describes the host (fake sysfs trees below: SMT 2-way on two nodes,
no SMT, one node with SMT), prints the map once, takes --cpus / POCKETLLM_CPUS instead, and binds
each rank's memory to its node on a host of several; a rank gives torch one thread per physical
core it has; a single-rank run stays unpinned. The TP=2 bench runs here also check the all-reduce
chosen, how ranks wait for it, the collectives a pass issues, that the launcher alone warns
about a variable pocketllm does not read, and (each run made once for the module) the note that
ranks on one NUMA node share one memory path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import cli_env, main_in_process, result_fields, shm_segments, usage_error_in_process
from pocketllm import launch, topology
from pocketllm.device_kind import allowed_cpus
from pocketllm.errors import UsageError
from pocketllm.topology import plan_ranks, read_cores


def fake_sysfs(root, nodes: dict[int, str], siblings: list[str] | None, ncpus: int):
    """A sysfs tree: each node's cpulist, and each CPU's core_cpus_list (None: no topology files)."""
    for node, cpulist in nodes.items():
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for cpu in range(ncpus):
        d = root / f"devices/system/cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        if siblings is not None:
            group = next(g for g in siblings if cpu in topology.parse_cpulist(g, "test"))
            (d / "thread_siblings_list").write_text(group + "\n")
    return str(root)


# Two sockets of 4 cores, 2 threads each, numbered as Linux does: node 0 holds CPUs 0-3 and their
# siblings 8-11, node 1 CPUs 4-7 and 12-15.
SMT2_TWO_NODES = ({0: "0-3,8-11", 1: "4-7,12-15"}, [f"{c},{c + 8}" for c in range(8)], 16)
NO_SMT_ONE_NODE = ({0: "0-3"}, [str(c) for c in range(4)], 4)
# One node, 2 cores of 2 threads, siblings numbered apart (0,2 and 1,3).
SMT2_ONE_NODE = ({0: "0-3"}, ["0,2", "1,3"], 4)


def plan(tmp_path, tree, world, cpus=None):
    root = fake_sysfs(tmp_path, *tree)
    ranks = plan_ranks(world, read_cores(cpus if cpus is not None else range(tree[2]), root))
    return [(list(r.cpus), r.cores, list(r.nodes)) for r in ranks]


@pytest.mark.parametrize(
    "tree, world, cpus, expected",
    [
        # One rank per node, each with its 4 cores and their siblings; the topology-blind split
        # gave rank 1 CPUs 8-15, the hyperthreads of rank 0's cores.
        (SMT2_TWO_NODES, 2, None, [([0, 1, 2, 3, 8, 9, 10, 11], 4, [0]), ([4, 5, 6, 7, 12, 13, 14, 15], 4, [1])]),
        (SMT2_TWO_NODES, 4, None, [([0, 1, 8, 9], 2, [0]), ([2, 3, 10, 11], 2, [0]), ([4, 5, 12, 13], 2, [1]), ([6, 7, 14, 15], 2, [1])]),
        # Three ranks fit per node at 2 cores each, not at 3 (which would span the nodes).
        (SMT2_TWO_NODES, 3, None, [([0, 1, 8, 9], 2, [0]), ([2, 3, 10, 11], 2, [0]), ([4, 5, 12, 13], 2, [1])]),
        # Fewer ranks than nodes: a rank takes whole nodes.
        (SMT2_TWO_NODES, 1, None, [(list(range(16)), 8, [0, 1])]),
        # More ranks than physical cores: ranks share cores round-robin.
        (SMT2_TWO_NODES, 10, None, [([0, 8], 1, [0]), ([1, 9], 1, [0]), ([2, 10], 1, [0]), ([3, 11], 1, [0]),
                                    ([4, 12], 1, [1]), ([5, 13], 1, [1]), ([6, 14], 1, [1]), ([7, 15], 1, [1]),
                                    ([0, 8], 1, [0]), ([1, 9], 1, [0])]),
        # Allowed only the first thread of node 0's cores (taskset -c 0-3): 4 cores of one thread.
        (SMT2_TWO_NODES, 2, [0, 1, 2, 3], [([0, 1], 2, [0]), ([2, 3], 2, [0])]),
        (NO_SMT_ONE_NODE, 2, None, [([0, 1], 2, [0]), ([2, 3], 2, [0])]),
        (NO_SMT_ONE_NODE, 3, None, [([0], 1, [0]), ([1], 1, [0]), ([2], 1, [0])]),
        (SMT2_ONE_NODE, 2, None, [([0, 2], 1, [0]), ([1, 3], 1, [0])]),
    ],
    ids=["smt2-2nodes-tp2", "smt2-2nodes-tp4", "smt2-2nodes-tp3", "smt2-2nodes-tp1", "smt2-2nodes-tp10-shared",
         "smt2-2nodes-first-threads", "nosmt-1node-tp2", "nosmt-1node-tp3-one-idle", "smt2-1node-tp2"],
)
def test_ranks_get_whole_cores_on_one_node(tree, world, cpus, expected, tmp_path):
    assert plan(tmp_path, tree, world, cpus) == expected


def test_without_sysfs_every_cpu_is_a_core_on_one_node(tmp_path):
    cores = read_cores([4, 6, 8], str(tmp_path))
    assert [(c.node, c.cpus) for c in cores] == [(0, (4,)), (0, (6,)), (0, (8,))]
    assert [r.cpus for r in plan_ranks(2, cores)] == [(4,), (6,)]


def test_the_launcher_maps_the_ranks_in_one_line(tmp_path):
    # The line rank 0 prints (the TP=2 runs below check it is printed once).
    root = fake_sysfs(tmp_path, *SMT2_TWO_NODES)
    ranks, line = launch.pin_map(2, env={}, sysfs=root, allowed=list(range(16)))
    assert [r.cpus for r in ranks] == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    assert line == (
        "pocketllm: pinned 2 ranks on 2 NUMA nodes, 8 cores, SMT 2-way: rank 0 CPUs 0-3,8-11 (node 0), rank 1 CPUs 4-7,12-15 (node 1); "
        "4 torch threads per rank"
    )
    assert launch.pin_map(2, env={"POCKETLLM_PIN_CPUS": "0"}, sysfs=root, allowed=list(range(16))) == (None, None)
    # Two nodes: each rank's memory is bound to its node, and the line says so (one node: nothing).
    bind, memory = launch._memory_binding(ranks)
    assert bind is not None and memory == "; each rank's memory bound to its node(s) (MPOL_BIND)"
    assert launch._memory_binding(plan_ranks(2, read_cores(range(4), fake_sysfs(tmp_path / "one", *NO_SMT_ONE_NODE)))) == (None, "")


@pytest.mark.parametrize(
    "given, expected",
    [("4-7,12-15/0-3,8-11", [(4, 5, 6, 7, 12, 13, 14, 15), (0, 1, 2, 3, 8, 9, 10, 11)]), ("0-1,8-9,4-5,12-13", [(0, 1, 8, 9), (4, 5, 12, 13)])],
    ids=["one-list-per-rank", "one-list-shared-out"],
)
def test_cpus_overrides_the_map(given, expected, tmp_path):
    root = fake_sysfs(tmp_path, *SMT2_TWO_NODES)
    assert [r.cpus for r in launch.pin_map(2, given, env={}, sysfs=root, allowed=list(range(16)))[0]] == expected
    # The environment's list when no flag is given.
    assert [r.cpus for r in launch.pin_map(2, env={"POCKETLLM_CPUS": given}, sysfs=root, allowed=list(range(16)))[0]] == expected


@pytest.mark.parametrize(
    "given, env, needle",
    [
        ("0-3/4-7/8", {}, "3 lists for 2 ranks"),
        ("0-3/4-99", {}, "CPU 16-99 is not one this process may run on (0-15)"),
        ("0-3/x", {}, "'x' is not a CPU number or range"),
        ("0/1", {"POCKETLLM_PIN_CPUS": "0"}, "--cpus pins the ranks and POCKETLLM_PIN_CPUS=0 says not to"),
    ],
)
def test_a_bad_cpus_list_is_a_usage_error(given, env, needle, tmp_path):
    root = fake_sysfs(tmp_path, *SMT2_TWO_NODES)
    with pytest.raises(UsageError, match="^--cpus ") as caught:
        launch.pin_map(2, given, env=env, sysfs=root, allowed=list(range(16)))
    assert needle in str(caught.value)


@pytest.mark.skipif(not os.path.exists("/proc/self/numa_maps"), reason="no NUMA memory policy on this kernel")
def test_a_rank_memory_binding_reaches_the_process(tmp_path):
    # The launcher binds a rank's memory between fork and exec, as it pins its cores; node 0 is
    # on every host, so the binding is tried there. A process's mappings show its policy.
    bind, why_not = topology.memory_binder()
    assert bind is not None, why_not
    maps = subprocess.run(["cat", "/proc/self/numa_maps"], capture_output=True, text=True, check=True,
                          preexec_fn=lambda: os._exit(3) if bind([0]) else None).stdout
    assert maps and all(line.split()[1] == "bind:0" for line in maps.splitlines()), maps
    plain = subprocess.run(["cat", "/proc/self/numa_maps"], capture_output=True, text=True, check=True).stdout
    assert " bind:" not in plain


@pytest.mark.parametrize("pinned,threads", [(True, 2), (False, 1)], ids=["pinned", "unpinned"])
def test_a_rank_takes_a_thread_per_physical_core(pinned, threads, tmp_path, monkeypatch):
    # A rank of two whose affinity holds two SMT cores (four CPUs): pinned by the launcher, both
    # cores are its own and it runs two threads; unpinned, it shares them with its peer: one.
    from pocketllm import device

    monkeypatch.setattr(topology, "SYSFS", fake_sysfs(tmp_path, *SMT2_ONE_NODE))
    monkeypatch.setattr(device, "allowed_cpus", lambda: [0, 1, 2, 3])
    if pinned:
        monkeypatch.setenv(device.ENV_RANK_CPUS, "0-3")
    else:
        monkeypatch.delenv(device.ENV_RANK_CPUS, raising=False)
    saved = torch.get_num_threads()
    try:
        device.setup_device("cpu", None, local_rank=0, world=2)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(saved)


# Each TP=2 run also carries the checks of other modules that only need a TP=2 bench: the
# all-reduce it chose (shm or gloo), how its ranks wait (polling or blocking), the collectives a
# pass issues at a pinned slice count, and /dev/shm left as it was found.
BENCH_RUNS = {
    # One rank is this command's own process, run here.
    "tp1": (1, {}, []),
    # Each rank on the other's cores (--cpus, given below as this process's last and first CPUs),
    # with a variable pocketllm does not read, which the launcher alone warns about.
    "tp2-cpus-reversed-shm-3-slices": (2, {"POCKETLLM_GEMV_KERNEL": "c"}, ["--collective", "shm", "--layers", 8, "--pin-slices", 3, "--cpus"]),
    # Started on one core only, both ranks share it: the launcher divides its own affinity, which
    # is how two launches are kept apart on one machine.
    "tp2-one-core-gloo-blocking-serial": (
        2, {"POCKETLLM_POLL_COLLECTIVES": "0", "POCKETLLM_COLLECTIVE": "gloo"}, ["--layers", 8, "--pin-slices", 1],
    ),
}


def bench_args(run: str, out) -> list:
    world, _, extra = BENCH_RUNS[run]
    if "--cpus" in extra:
        mine = allowed_cpus()
        extra = [*extra, f"{mine[-1]}/{mine[0]}"]
    return ["bench", "--preset", "tiny", "--tp-world", world, "--prompt-tokens", 16, "--max-new-tokens", 2, "--warmup-tokens", 4, "--json", out, *extra]


@pytest.fixture(scope="module")
def tp2_bench(tmp_path_factory):
    """The TP=2 runs of BENCH_RUNS this machine makes, all started the first time a test of this
    module asks for one (the one-core run keeps one core busy for seconds, leaving the other to
    the rest), each test then waiting for its own: get(run) gives (its completed process, its
    --json settings or None), and segments() /dev/shm's pocketllm segments before the runs and
    after every one of them has ended."""
    mine = allowed_cpus()
    before = shm_segments()
    procs, outs = {}, {}
    for run, (world, env, extra) in BENCH_RUNS.items():
        if world == 1 or ("--cpus" in extra and len(mine) < 2):
            continue
        outs[run] = tmp_path_factory.mktemp(run) / "r.json"
        preexec = (lambda: os.sched_setaffinity(0, mine[:1])) if "one-core" in run else None
        cmd = [sys.executable, "-m", "pocketllm", *map(str, bench_args(run, outs[run]))]
        procs[run] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(**env), preexec_fn=preexec)
    done = {}

    def get(run: str):
        if run not in done:
            out, err = procs[run].communicate(timeout=120)
            r = subprocess.CompletedProcess(procs[run].args, procs[run].returncode, out, err)
            done[run] = r, json.loads(outs[run].read_text())["settings"] if r.returncode == 0 else None
        return done[run]

    def segments():
        for run in procs:
            get(run)
        return before, shm_segments()

    yield get, segments
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", list(BENCH_RUNS))
def test_bench_ranks_run_on_their_share_of_the_cores(run, tmp_path, capsys, request):
    world, env, extra = BENCH_RUNS[run]
    mine = allowed_cpus()
    if "--cpus" in extra and len(mine) < 2:
        pytest.skip("--cpus 1/0 needs two CPUs")
    if world == 1:
        out = tmp_path / "r.json"
        segments = shm_segments()
        rc = main_in_process(*bench_args(run, out))
        stdout, stderr = capsys.readouterr()
        assert rc == 0, stderr
        settings = json.loads(out.read_text())["settings"]
        segments_after = shm_segments()
    else:
        # Asked for here, not as a parameter: the TP=2 runs start after this process's own run.
        get, both_segments = request.getfixturevalue("tp2_bench")
        r, settings = get(run)
        stdout, stderr = r.stdout, r.stderr
        assert r.returncode == 0, stderr
        segments, segments_after = both_segments()
    maps = [line for line in stderr.splitlines() if line.startswith("pocketllm: pinned ")]
    if world == 1:
        assert settings["cpus_per_rank"] == [mine]
        assert settings["threads_per_rank"] == len(mine)
        assert maps == []
    elif "one-core" in run:
        assert settings["cpus_per_rank"] == [mine[:1]] * 2 and settings["threads_per_rank"] == 1
        assert maps == [f"pocketllm: pinned 2 ranks on 1 NUMA node, 1 core, no SMT: rank 0 CPU {mine[0]}, rank 1 CPU {mine[0]}; 1 torch thread per rank"]
    else:
        assert settings["cpus_per_rank"] == [[mine[-1]], [mine[0]]]
        assert settings["threads_per_rank"] == 1
        assert len(maps) == 1, stderr
    warnings = [line for line in stderr.splitlines() if "POCKETLLM_GEMV_KERNEL" in line]
    assert len(warnings) == ("POCKETLLM_GEMV_KERNEL" in env), stderr
    assert len(settings["peak_rss_mib_per_rank"]) == world and min(settings["peak_rss_mib_per_rank"]) > 0
    # gloo ranks poll for their collectives unless told not to; one rank has none to wait for.
    assert settings["polls_collectives"] is (world > 1 and env.get("POCKETLLM_POLL_COLLECTIVES") != "0")
    notes = [line for line in stderr.splitlines() if line.startswith("all-reduce:")]
    if world == 1:
        assert settings["collective"] is None and notes == []
    elif "--collective" in extra:
        assert settings["collective"] == "shm"
        assert notes == ["all-reduce: shm (shared memory, 2 CPU ranks on this host; gloo for the other collectives)"]
    else:
        # Asked for by the variable, and said so (not as a flag the command line lacks).
        assert settings["collective"] == "gloo"
        assert notes == ["all-reduce: gloo (POCKETLLM_COLLECTIVE=gloo)"]
    if world > 1:
        # A pass issues one all-reduce per slice at each of the 8 layers' mlp.down, the 6
        # linear-attention and 2 full-attention output projections, plus the embedding's.
        fields = result_fields(stdout)
        slices = int(extra[extra.index("--pin-slices") + 1])
        assert int(fields["slices"]) == slices
        assert int(fields["collectives"]) == 8 * slices + 6 * slices + 2 * slices + 1
    assert segments_after == segments


@pytest.mark.parametrize("switch", ["POCKETLLM_PIN_CPUS", "POCKETLLM_POLL_COLLECTIVES"])
def test_a_bad_launcher_switch_is_a_usage_error(switch, capsys, no_ranks, monkeypatch):
    monkeypatch.setenv(switch, "maybe")
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--tp-world", "2", expect=f"{switch}='maybe' is not a switch")


def test_ranks_on_one_node_share_one_memory_path_and_ranks_on_two_do_not(tmp_path):
    from pocketllm.distributed.one_host import shared_node

    two = fake_sysfs(tmp_path / "two", *SMT2_TWO_NODES)
    assert shared_node([[0, 8], [1, 9]], two) == 0
    assert shared_node([[0, 8], [4, 12]], two) is None
    assert shared_node([[0, 1], [2, 3]], fake_sysfs(tmp_path / "one", *NO_SMT_ONE_NODE)) == 0


@pytest.mark.timeout(120)
def test_two_ranks_on_one_node_say_tp_cannot_pay_there_with_the_measured_all_reduce(tp2_bench):
    # The one-core bench run's ranks share one core, so one NUMA node on any host: rank 0 must
    # print the note once, with the all-reduce it timed on the run's own collective.
    get, _ = tp2_bench
    r, _ = get("tp2-one-core-gloo-blocking-serial")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "share one memory path" in line]
    assert len(notes) == 1 and re.search(r"\(\d+ us each here, measured now\)", notes[0]) and "--tp-world 1 decodes at least as fast" in notes[0], notes

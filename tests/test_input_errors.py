"""Bad input: one line on stderr naming what is wrong, exit code 2, no traceback, no rank started.

The cases call the CLI in this process at --tp-world 2, where the launcher checks the input before
it would start a rank (no_ranks fails the test if one is started); a bad flag value and an
unreadable token-ids file at the default single rank run `python -m pocketllm` for real, so the
exit status and the clean stderr of an actual process stay covered."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import free_port, main_in_process, start, usage_error_in_process, usage_line

CASES = {
    "negative-id": (["--token-ids", "1,-2,3"], "--token-ids: token id -2 at position 1 is outside the vocab [0, 1000)"),
    "id-over-vocab": (["--token-ids", "1,1000"], "--token-ids: token id 1000 at position 1 is outside the vocab"),
    "id-over-vocab-second": (["--token-ids", "1", "--token-ids", "1,1000"], "--token-ids #2: token id 1000 at position 1 is outside the vocab"),
    "empty-prompt": (["--token-ids", ""], "--token-ids: the prompt is empty"),
    "over-max-positions": (["--token-ids", "1,2", "--max-new-tokens", "40000"], "over max_position_embeddings=32768"),
    "junk-id": (["--token-ids", "1,x2,3"], "'x2' is not an integer token id"),
    "id-left-out": (["--token-ids", "1,,3"], "--token-ids: an id is missing between commas"),
    "tp-world-zero": (["--token-ids", "1", "--tp-world", "0"], "--tp-world must be >= 1, got 0"),
    "unknown-preset": (["--token-ids", "1", "--preset", "huge"], "unknown preset 'huge'"),
    "bad-dtype": (["--token-ids", "1", "--dtype", "fp8"], "--dtype 'fp8' is not one of"),
    "negative-pin": (["--token-ids", "1", "--pin-slices", "-1"], "--pin-slices must be a non-negative integer, got -1"),
    "text-pin": (["--token-ids", "1", "--pin-slices", "two"], "--pin-slices must be a non-negative integer, got 'two'"),
    "prompt-without-tokenizer": (["--prompt", "hello"], "--prompt needs a checkpoint with tokenizer.json"),
    "stream-without-tokenizer": (["--token-ids", "1", "--stream"], "--stream needs a checkpoint with tokenizer.json"),
    "nan-temperature": (["--token-ids", "1", "--temperature", "nan"], "--temperature must be a number >= 0, got nan"),
    "seed-over-64-bits": (["--token-ids", "1", "--seed", str(2**64)], "--seed must fit in 64 bits"),
    "nan-timeout": (["--token-ids", "1", "--dist-timeout", "nan"], "--dist-timeout must be a number of seconds in (0, 1000000000], got nan"),
    "logits-out-a-directory": (["--token-ids", "1", "--logits-out", "."], "--logits-out .: is a directory"),
    "logits-out-empty": (["--token-ids", "1", "--logits-out", ""], "--logits-out is empty"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_generate_input(case, capsys, no_ranks):
    args, message = CASES[case]
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--tp-world", "2", *args, expect=message)


@pytest.fixture(scope="module")
def real_processes(tmp_path_factory):
    """The two cases below, each a real `python -m pocketllm` that spends about a second of one
    core starting torch, started together the first time a test asks; each test waits for its own."""
    tmp_path = tmp_path_factory.mktemp("real")
    runs = {
        "missing-token-ids-file": start("generate", "--preset", "tiny", "--token-ids-file", tmp_path / "none.txt", tmp_path=tmp_path),
        "bad-flag-value": start("bench", "--prompt-tokens", "many", tmp_path=tmp_path),
    }
    yield runs
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.wait()


def test_missing_token_ids_file(real_processes):
    # In a real process at one rank: that process is the rank and checks the input itself, and the
    # UsageError it raises must still end as one line and exit 2 from `python -m pocketllm`.
    run = real_processes["missing-token-ids-file"]
    usage_line(run.wait(), run.stderr, ["none.txt: cannot read"])


def test_bad_flag_value_is_one_line(real_processes):
    # In a real process: argparse rejects the value and exits from inside parse_args, a path that
    # does not go through main()'s UsageError handling.
    run = real_processes["bad-flag-value"]
    usage_line(run.wait(), run.stderr, ["--prompt-tokens", "'many'"])


def test_token_ids_file_and_text_prompt_through_tokenizer(tiny_ckpt, tmp_path, capsys):
    f = tmp_path / "ids.txt"
    f.write_text("104 101\n108,108 111")

    def stdout(*source):
        capsys.readouterr()
        rc = main_in_process("generate", "--ckpt", tiny_ckpt, *source, "--max-new-tokens", 3)
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out.splitlines()

    by_file, by_text = stdout("--token-ids-file", f), stdout("--prompt", "hello")
    # "hello" is 104 101 108 108 111 in the byte-level tokenizer: the same ids, then the text.
    assert by_file[0] == by_text[0] and len(by_text) == 2


def test_a_broken_tokenizer_is_named_before_the_run(ckpt_copy, capsys, no_ranks):
    (ckpt_copy / "tokenizer.json").write_text("{not json")
    usage_error_in_process(capsys, "generate", "--ckpt", ckpt_copy, "--token-ids", "1,2", "--tp-world", "2", expect=("tokenizer.json is not a readable tokenizer",))


def test_stream_needs_the_checkpoints_tokenizer(ckpt_copy, capsys, no_ranks):
    (ckpt_copy / "tokenizer.json").unlink()
    usage_error_in_process(capsys, "generate", "--ckpt", ckpt_copy, "--token-ids", "1,2", "--stream", "--tp-world", "2", expect=f"--stream needs {ckpt_copy / 'tokenizer.json'}, which does not exist")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", ["generate", "allreduce"])
def test_hand_started_rank_refuses_a_bad_timeout_before_joining(command, tmp_path, capsys, no_ranks, monkeypatch):
    # Rank 1 started by hand never runs rank 0's checks; it must refuse a bad --dist-timeout
    # itself, not wait for a group that rank 0 will never form. (It then waits the bound, here
    # 0.1 s, for a rank 0's file to tell it.)
    monkeypatch.setenv("POCKETLLM_RENDEZVOUS_WAIT_ATTEMPTS", "10")
    extra = ["--preset", "tiny", "--token-ids", "1,2"] if command == "generate" else []
    usage_error_in_process(
        capsys, command, *extra, "--tp-world", "2", "--tp-rank", "1", "--rendezvous-file", tmp_path / "run.id", "--dist-timeout", "-1",
        "--device", "cpu",  # were the check gone, this process would become the rank: never on a GPU
        expect="--dist-timeout must be a number of seconds in (0, 1000000000], got -1",
    )


@pytest.mark.parametrize("flag,what", [("--ckpt", "checkpoint directory"), ("--preset", "preset name")])
def test_an_empty_source_is_refused_not_read_as_the_default(flag, what, capsys, no_ranks):
    usage_error_in_process(capsys, "generate", flag, "", "--token-ids", "1", "--tp-world", "2", expect=f"{flag} is empty: give a {what}")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("command,sized_by", [("bench", "--prompt-tokens"), ("profile", "--prompt-tokens"), ("sweep", "--rows")])
def test_a_prompt_past_the_models_positions_is_refused_before_its_ids_are_made(command, sized_by, capsys, no_ranks):
    # 10**9 ids as a Python list would take minutes and tens of GiB: the length is checked first
    # (refused in well under a second; a list being built would be timed out here, at a few GiB).
    line = usage_error_in_process(capsys, command, "--preset", "tiny", "--tp-world", "2", sized_by, str(10**9), expect="over max_position_embeddings=")
    # The flag that sized the prompt is named; profile asks for no new tokens and has no flag for them.
    assert f"tokens ({sized_by})" in line and (("new tokens (--max-new-tokens)" in line) == (command != "profile")), line


def test_a_bad_prompt_names_the_flag_or_file_it_came_from(tmp_path, tiny_ckpt, capsys, no_ranks):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 5000\n")
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--tp-world", "2", "--token-ids-file", ids,
                           expect=f"--token-ids-file {ids}: token id 5000 at position 1 is outside the vocab")
    usage_error_in_process(capsys, "generate", "--ckpt", tiny_ckpt, "--tp-world", "2", "--prompt", "hi", "--prompt", "",
                           expect="--prompt #2 is empty: give at least one token")


def test_a_bench_given_several_prompts_says_it_times_one(capsys, no_ranks):
    # generate takes a repeated --token-ids as several prompts; a bench kept the last one silently.
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--tp-world", "2", "--token-ids", "1,2,3", "--token-ids", "4",
                           expect="--token-ids given 2 times: a bench times one prompt")


def test_a_bench_that_fills_the_models_positions_runs_and_one_past_is_refused(ckpt_copy, capsys):
    """A bench's --max-new-tokens N timed steps read the prompt and N tokens after it (the last
    token chosen is never read): prompt + N up to max_position_embeddings runs, one more is the
    one-line refusal."""
    path = ckpt_copy / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_position_embeddings": 64}))
    capsys.readouterr()
    rc = main_in_process("bench", "--ckpt", ckpt_copy, "--prompt-tokens", 60, "--max-new-tokens", 4)
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    usage_error_in_process(capsys, "bench", "--ckpt", ckpt_copy, "--prompt-tokens", 61, "--max-new-tokens", 4, expect="prompt of 61 tokens (--prompt-tokens) plus 4 new tokens (--max-new-tokens) is 65, over max_position_embeddings=64")


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_a_json_path_that_is_a_directory_is_refused_before_the_run(command, tmp_path, capsys, no_ranks):
    usage_error_in_process(capsys, command, "--preset", "tiny", "--tp-world", "2", "--json", tmp_path, expect=f"--json {tmp_path}: is a directory")


def test_torchrun_env_without_tp_world_plans_for_its_world_size(capsys, no_ranks, monkeypatch):
    # torchrun gives WORLD_SIZE; --tp-world may be left out, so the split is checked for 3 ranks
    # (the tiny preset's 4 heads do not split 3 ways), not for the flag's default of 1. As rank 0
    # of torchrun's world this process would go on to the rendezvous after its own check: joining
    # a group fails the test instead.
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("the process joined a group before refusing the split")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    usage_error_in_process(
        capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--max-new-tokens", 1, "--dist-timeout", 3,
        expect=("over 3 ranks", "valid world sizes: 1, 2, 4"),
    )


@pytest.mark.parametrize("env, message, flags", [
    ({"RANK": "1", "WORLD_SIZE": "1"}, "torchrun's RANK=1 is outside its WORLD_SIZE=1", []),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "torchrun's WORLD_SIZE='two' is not an integer", []),
    ({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "torchrun's RANK=5 is outside its WORLD_SIZE=2", []),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "but MASTER_ADDR and MASTER_PORT not", []),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
     "torchrun's LOCAL_RANK=3 is outside its LOCAL_WORLD_SIZE=2", []),
    # A hand-started rank's flags under torchrun were ignored: every process said --tp-rank 0.
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "--tp-rank and --rendezvous-file: for ranks started by hand; under torchrun", ["--tp-rank", "0", "--rendezvous-file", "r.id"]),
], ids=["rank-past-world", "world-not-int", "rank-past-world-2", "no-master", "local-rank-past", "hand-flags"])
def test_torchrun_variables_that_cannot_describe_a_run_are_one_line(env, message, flags, capsys, no_ranks, monkeypatch):
    """RANK and WORLD_SIZE set by hand, or by a launcher other than torchrun: a value that cannot
    place this rank is named before it joins any group (which would fail in torch's words)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined a group"))
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--max-new-tokens", 1, "--device", "cpu", *flags,
                           expect=message)


def test_one_device_index_for_every_rank_torchrun_starts_on_a_host_is_refused(monkeypatch):
    """torchrun gives every rank of a host one command line: --device N would put them all on one
    GPU (NCCL refuses two ranks on one). Hand-started ranks each name their own, by flags or by
    RANK and WORLD_SIZE alone (no LOCAL_WORLD_SIZE: torchrun always sets it)."""
    from pocketllm.commands.settings import _check_rank_placement
    from pocketllm.errors import UsageError
    from pocketllm.place import RankEnv
    from pocketllm.run_plan import DevicePlan

    torchrun = RankEnv(rank=1, world=2, local_rank=1, local_world=2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _check_rank_placement(None, DevicePlan("1", "cuda", 1), 2, torchrun)  # RANK and WORLD_SIZE set by hand
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"^--device 1 names one device for each of this host's 2 ranks: give --device cuda "):
        _check_rank_placement(None, DevicePlan("1", "cuda", 1), 2, torchrun)
    _check_rank_placement(None, DevicePlan("cuda", "cuda"), 2, torchrun)
    _check_rank_placement(None, DevicePlan("1", "cuda", 1), 2, RankEnv(rank=1, world=2, local_rank=1, local_world=2, id_path="r.id"))
    _check_rank_placement(None, DevicePlan("1", "cuda", 1), 2, RankEnv(rank=1, world=2, local_rank=0, local_world=1))


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_rendezvous_file_without_a_rank_is_refused_not_ignored(world, capsys, no_ranks):
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--tp-world", world, "--nccl-id-path", "x.id",
                           expect="--rendezvous-file is for ranks started by hand: give each one --tp-rank i too")


def test_an_output_inside_the_checkpoint_read_is_refused_and_nothing_there_changes(ckpt_copy, capsys, no_ranks):
    # Written over a shard or config.json, a results file would leave a checkpoint that no longer loads.
    before = {f.name: f.read_bytes() for f in ckpt_copy.iterdir()}
    for command, flag, name in (("generate", "--logits-out", "model.safetensors"), ("bench", "--json", "config.json"),
                                ("profile", "--json", "new.json"), ("sweep", "--plot", "sweep.png")):
        extra = ["--token-ids", "1,2"] if command == "generate" else []
        usage_error_in_process(capsys, command, "--ckpt", ckpt_copy, *extra, flag, ckpt_copy / name,
                               expect=f"{flag} {ckpt_copy / name} is inside --ckpt {ckpt_copy}, the checkpoint this run reads")
    assert {f.name: f.read_bytes() for f in ckpt_copy.iterdir()} == before


@pytest.mark.parametrize("command, flags, refused", [
    ("generate", ["--token-ids", "1,2", "--max-new-tok", "2"], "--max-new-tok"),
    # bench has no --prompt: a prefix of --prompt-tokens, it must not become that flag.
    ("bench", ["--prompt", "64"], "--prompt"),
])
def test_a_flags_prefix_is_not_taken_for_the_flag(command, flags, refused, capsys, no_ranks):
    usage_error_in_process(capsys, command, "--preset", "tiny", "--tp-world", "2", *flags, expect=f"unrecognized arguments: {refused}")


def test_weights_holding_nan_are_named_not_generated_from(ckpt_copy, capsys):
    from safetensors.torch import load_file, save_file

    path = ckpt_copy / "model.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path)
    # Found at the first token, after the load's lines: the run's last line, exit 2, no traceback.
    assert main_in_process("generate", "--ckpt", ckpt_copy, "--token-ids", "1,2,3", "--max-new-tokens", 4) == 2
    out, err = capsys.readouterr()
    assert "generated_ids" not in out and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("pocketllm: error: the model's logits for the prompt are not finite (NaN or inf)")


@pytest.mark.parametrize("command, args, expect", [
    # The ids are the prompt: a --prompt-tokens beside them was dropped without a word.
    ("bench", ["--prompt-tokens", "8", "--token-ids", "1,2"], "--prompt-tokens sizes the deterministic prompt, which --token-ids replaces"),
    # Named as given, not as a list of flags this command may not have.
    ("bench", ["--token-ids", "1,2", "--token-ids-file", "f.txt"], "give one way of giving the prompt, not --token-ids, --token-ids-file"),
    # One bound, said once: -1 was refused as below 0, then 0 as below 1.
    ("bench", ["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1 for a bench, got -1"),
])
def test_prompt_flags_that_contradict_each_other_are_refused(command, args, expect, capsys, no_ranks):
    usage_error_in_process(capsys, command, "--preset", "tiny", "--tp-world", "2", *args, expect=expect)


def test_device_cuda_on_a_cpu_only_torch_says_so(capsys, no_ranks, monkeypatch):
    """A CPU-only torch cannot see a GPU whatever the driver: the line says which it is."""
    from pocketllm import device_kind

    monkeypatch.setattr(device_kind, "cuda_available", lambda: False)
    monkeypatch.setattr(device_kind, "torch_has_gpu_build", lambda: False)
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--device", "cuda",
                           expect="--device cuda: the installed torch is a CPU-only build; install a CUDA build of torch")
    monkeypatch.setattr(device_kind, "torch_has_gpu_build", lambda: True)
    monkeypatch.setattr(device_kind, "torch_may_see_a_gpu", lambda: True)
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--device", "cuda", expect="--device cuda: no CUDA device is visible to torch")
    monkeypatch.setattr(device_kind, "torch_may_see_a_gpu", lambda: False)
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--device", "cuda",
                           expect="--device cuda: this machine has no GPU driver for torch to use (CUDA's libcuda.so.1, ROCm's /dev/kfd)")


@pytest.mark.parametrize("build", ["cuda", "hip"])
def test_a_gpu_build_of_torch_is_asked_for_a_gpu_only_where_its_driver_is(build, monkeypatch):
    """pip's default torch on Linux is the CUDA build, CPU-only machines included: there the
    launcher learns there is no GPU without importing torch (its ranks start sooner), and where
    the driver is, torch itself answers."""
    from pocketllm import device_kind

    monkeypatch.setattr(device_kind, "_torch_gpu_builds", lambda: {build})
    monkeypatch.setattr(device_kind, "_driver_present", lambda b: False)

    def asked():
        raise AssertionError("torch was asked for a GPU on a machine without the driver")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    assert not device_kind.torch_may_see_a_gpu() and not device_kind.cuda_available()
    assert device_kind.resolve_kind("auto") == "cpu"
    monkeypatch.setattr(device_kind, "_driver_present", lambda b: b == build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_kind.torch_may_see_a_gpu() and device_kind.cuda_available()
    # A version file that cannot say: torch is asked.
    monkeypatch.setattr(device_kind, "_torch_gpu_builds", lambda: None)
    monkeypatch.setattr(device_kind, "_driver_present", lambda b: False)
    assert device_kind.cuda_available()


def test_device_takes_torchs_kind_and_index_spelling(capsys, no_ranks, monkeypatch):
    """--device cuda:1 is device 1 of CUDA's (torch's own spelling), held to the count torch sees;
    a spelling of no kind is refused naming what is taken."""
    from pocketllm import device_kind

    assert device_kind.parse_device("cuda:1") == ("cuda", 1) and device_kind.parse_device(" npu:0 ") == ("npu", 0)
    monkeypatch.setattr(device_kind, "cuda_available", lambda: True)
    monkeypatch.setattr(device_kind, "_device_count", lambda kind: 1)
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--device", "cuda:1", expect="--device cuda:1: torch sees 1 cuda device(s), 0..0")
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--device", "cpu:0",
                           expect="--device 'cpu:0' is not one of auto, cpu, cuda, npu, cuda:N, npu:N or a device index N")

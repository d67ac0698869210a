"""The one TP-invariance matrix, with transformers as the oracle: pocketllm's prefill logits and
greedy tokens must match HF's Qwen3_5ForCausalLM on the same safetensors checkpoint at TP=1, 2 and
4, however the ranks were started (in this process, by pocketllm's launcher, by torchrun, or one
process per rank by hand), on the serial path and on the sliced one (pinned, and the rule's own
choice on a prompt long enough for it), and seeded sampling across ranks draws TP=1's tokens.
Each world size is launched as few times as the modes need; the multi-rank runs sum through the
shared-memory all-reduce."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (a declared test dependency: a broken install fails here, loudly)
from safetensors.torch import load_file

from conftest import cli_env, generated_ids, main_in_process, run_cli
from hf_oracle import build_hf_model, build_hf_release_layout_model, hf_greedy, hf_prefill_logits, save_hf_checkpoint
from pocketllm.distributed.policy import comm_overlap_slices_for_rows

PROMPT = [(7 * i + 3) % 200 for i in range(70)]
NEW_TOKENS = 16
# Past 2048 rows the default rule (ceiling 4, at least 1024 rows a slice) takes 2 slices; past
# 1024 tokens the conv's blocked multiply-adds, several row blocks of the norms and activation,
# and more than one precompute block of the chunked gated delta rule run too.
LONG_PROMPT = [(13 * i + 5) % 250 for i in range(2100)]
LONG_NEW_TOKENS = 4

CASES = {
    # vocab 251 is a multiple of neither 2 nor 4; one KV head is fewer than 2 or 4 ranks.
    "vocab251-kv1-untied": dict(vocab=251, kv_heads=1, tie=False),
    "vocab250-kv2-tied": dict(vocab=250, kv_heads=2, tie=True, seed=3),
}
SAMPLING = ["--temperature", "1.5", "--top-p", "0.95"]

# (case, world, how the ranks start, extra flags). Every prompt row count here is at least the
# pinned slice count, so a pinned run slices for real (70 rows over up to 8 slices).
RUNS = [
    ("vocab251-kv1-untied", 1, "in-process", []),
    ("vocab251-kv1-untied", 2, "torchrun", ["--pin-slices", "2"]),
    ("vocab251-kv1-untied", 4, "launcher", ["--pin-slices", "8"]),
    ("vocab250-kv2-tied", 1, "in-process", []),
    # Serial (70 rows: the rule keeps one slice), and sampled: its tokens are checked against
    # TP=1's draw with the same seed. (A TP=4 launch of 5 processes on the 2-core test machine
    # costs more than the rest of the file: one is enough.)
    ("vocab250-kv2-tied", 2, "by-hand", [*SAMPLING, "--seed", "7"]),
]


@pytest.fixture(scope="module")
def oracles(tmp_path_factory):
    """Each case's checkpoint and HF's answers, built once the first run needs them."""
    built = {}

    def get(name):
        if name not in built:
            model = build_hf_model(**CASES[name])
            ckpt = save_hf_checkpoint(model, tmp_path_factory.mktemp(name))
            built[name] = ckpt, hf_prefill_logits(model, PROMPT), hf_greedy(model, PROMPT, NEW_TOKENS)
        return built[name]

    return get


def generate(mode: str, world: int, ckpt: Path, ids: list[int], new_tokens: int, logits: Path, extra, capsys, tmp_path) -> str:
    """Run `pocketllm generate` on ckpt with its ranks started as `mode`; rank 0's stdout."""
    args = [
        "generate", "--ckpt", ckpt, "--dtype", "float32", "--token-ids", ",".join(map(str, ids)),
        "--max-new-tokens", new_tokens, "--logits-out", logits, "--dist-timeout", 30, *extra,
    ]
    if world > 1:
        # Named, so that the sums are surely the shared-memory all-reduce's, not a fallback's.
        args += ["--collective", "shm"]
    args = [str(a) for a in args]
    if mode == "in-process":
        assert world == 1
        capsys.readouterr()
        rc = main_in_process(*args)
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out
    if mode == "launcher":
        r = run_cli(*args, "--tp-world", world)
        assert r.returncode == 0, r.stderr
        return r.stdout
    if mode == "torchrun":
        torchrun = Path(sys.executable).with_name("torchrun")
        # No --tp-world: the world size comes from torchrun.
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(world), "-m", "pocketllm", *args]
        # torchrun makes a log directory in TMPDIR and leaves it: this test's, not the machine's.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env(TMPDIR=str(tmp_path)))
        assert r.returncode == 0, r.stderr
        return r.stdout
    assert mode == "by-hand"
    rdzv = tmp_path / "run.id"
    # Odd ranks name the file by the seed's flag, --nccl-id-path, an alias of --rendezvous-file.
    flags = [["--rendezvous-file" if r % 2 == 0 else "--nccl-id-path", str(rdzv), "--tp-rank", str(r)] for r in range(world)]
    cmd = [sys.executable, "-m", "pocketllm", *args, "--tp-world", str(world)]
    procs = [subprocess.Popen([*cmd, *flags[r]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env()) for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * world, "".join(err for _, err in outs)
    # Only rank 0 prints results.
    assert all(out.strip() == "" for out, _ in outs[1:])
    return outs[0][0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case,world,mode,extra", RUNS, ids=[f"{c.split('-')[0]}-{c.split('-')[1]}-tp{w}-{m}" for c, w, m, _ in RUNS])
def test_logits_and_greedy_tokens_match_transformers(oracles, case, world, mode, extra, capsys, tmp_path):
    ckpt, ref_logits, ref_tokens = oracles(case)
    logits_path = tmp_path / "logits.safetensors"
    stdout = generate(mode, world, ckpt, PROMPT, NEW_TOKENS, logits_path, extra, capsys, tmp_path)
    logits = load_file(str(logits_path))["logits"]
    assert logits.shape == ref_logits.shape
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-3)
    tokens = generated_ids(stdout)
    if "--temperature" not in extra:
        assert tokens == ref_tokens
        return
    # Rank 0 draws and every rank takes its token: the same seed draws the same tokens in this
    # process at TP=1; another seed, or greedy decoding, continues differently.
    def sampled(seed):
        flags = [*SAMPLING, "--seed", seed]
        return generated_ids(generate("in-process", 1, ckpt, PROMPT, NEW_TOKENS, tmp_path / f"{seed}.safetensors", flags, capsys, tmp_path))

    seed = extra[extra.index("--seed") + 1]
    assert len(tokens) == NEW_TOKENS
    assert sampled(seed) == tokens
    assert sampled(int(seed) + 1) != tokens and ref_tokens != tokens


@pytest.mark.timeout(180)
def test_a_long_prompt_takes_the_rules_sliced_path_and_matches_transformers(tmp_path, capsys):
    assert comm_overlap_slices_for_rows(len(LONG_PROMPT)) == 2
    model = build_hf_model(**CASES["vocab251-kv1-untied"], max_positions=4096)
    ckpt = save_hf_checkpoint(model, tmp_path / "ckpt")
    ref_logits, ref_tokens = hf_prefill_logits(model, LONG_PROMPT), hf_greedy(model, LONG_PROMPT, LONG_NEW_TOKENS)
    logits_path = tmp_path / "logits.safetensors"
    stdout = generate("launcher", 2, ckpt, LONG_PROMPT, LONG_NEW_TOKENS, logits_path, [], capsys, tmp_path)
    torch.testing.assert_close(load_file(str(logits_path))["logits"], ref_logits, atol=2e-4, rtol=1e-3)
    assert generated_ids(stdout) == ref_tokens


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_checkpoint_in_the_released_layout_gives_transformers_logits(tmp_path, capsys, tie):
    """The layout the released checkpoints have (Qwen3_5ForConditionalGeneration: the text model
    under model.language_model beside a vision tower, multimodal rope sections, a nested
    text_config): the text model is read from it, the rest skipped, and a prompt (text positions
    only, where the sections rotate as one) gets transformers' logits. Tied, as transformers saves
    it: the outer config says so, its text_config says false, and no lm_head.weight is written."""
    model = build_hf_release_layout_model(tie=tie)
    ckpt = save_hf_checkpoint(model, tmp_path / "ckpt")
    logits_path = tmp_path / "logits.safetensors"
    generate("in-process", 1, ckpt, PROMPT, 1, logits_path, [], capsys, tmp_path)
    torch.testing.assert_close(load_file(str(logits_path))["logits"], hf_prefill_logits(model, PROMPT), atol=2e-4, rtol=1e-3)

"""Many sequences at once: a packed pass equals each sequence's own passes, and the scheduler's
batches give every sequence the tokens it gets alone, whatever else runs beside it (fp32, tiny
preset, in process at TP=1; one CLI run at TP=2 against transformers)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import feed, generated_ids, main_in_process, run_cli, tiny_engine, usage_error_in_process
from hf_oracle import build_hf_model, hf_greedy, save_hf_checkpoint

from pocketllm.engine.generate import generate
from pocketllm.engine.sampling import SamplingParams
from pocketllm.engine.generate import generate_batch
from pocketllm.engine.scheduler import Scheduler

torch.set_num_threads(2)

# Lengths chosen to cover a one-token prompt, one shorter than the conv window, and several
# crossing the chunked rule's 64-row chunks.
LENGTHS = (5, 1, 70, 3, 130, 2)
NEW = 10


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def prompt(n: int, offset: int) -> list[int]:
    return [(31 * i + 7 * offset + 3) % 1000 for i in range(n)]


@pytest.fixture(scope="module")
def prompts():
    return [prompt(n, i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def alone(engine, prompts):
    return [generate(engine, p, NEW) for p in prompts]


def test_a_packed_pass_equals_each_sequence_alone(engine, prompts):
    spans = [(slot, 0, torch.tensor(p)) for slot, p in enumerate(prompts[:4])]
    engine.reserve_slots(4, 200)
    packed = engine.run_packed(spans)
    # Then a decode row each, at each sequence's own position, in a shuffled slot order.
    order = [2, 0, 3, 1]
    step = engine.run_packed([(s, len(prompts[s]), torch.tensor([s + 10])) for s in order])
    for slot, p in enumerate(prompts[:4]):
        torch.testing.assert_close(packed[slot], feed(engine, p), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(step[order.index(slot)], feed(engine, [slot + 10], len(p)), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("max_running,budget", [(6, 2048), (2, 2048), (3, 16)], ids=["all-at-once", "admitted-mid-way", "chunked-prompts"])
def test_batched_greedy_tokens_equal_each_sequence_alone(engine, prompts, alone, max_running, budget):
    sched = Scheduler(engine, max_running, max(LENGTHS) + NEW, prefill_budget=budget)
    requests = [sched.submit(p, NEW) for p in prompts]
    widest = 0
    while sched.has_work:
        sched.step()
        widest = max(widest, sched.num_running)
    assert widest == max_running
    assert [r.output for r in requests] == alone
    assert all(r.finish_reason == "length" for r in requests)
    assert sorted(sched.free_slots) == list(range(max_running))


def test_seeded_sampling_is_per_sequence(engine, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    # Prompt i of a batch draws with the seed + i: what it gets alone with that seed.
    alone = [generate(engine, p, NEW, replace(params, seed=11 + i)) for i, p in enumerate(prompts[:4])]
    assert generate_batch(engine, prompts[:4], NEW, params) == alone
    assert len({tuple(a) for a in alone}) == 4
    # The same prompt twice is two samples, not one stream drawn twice.
    twice = generate_batch(engine, [prompts[0], prompts[0]], NEW, params)
    assert twice[0] == alone[0] and twice[1] != twice[0]


def test_a_sequence_that_meets_eos_ends_early_and_frees_its_slot(engine, prompts, alone):
    eos = alone[0][3]  # the first sequence's fourth token
    sched = Scheduler(engine, 2, max(LENGTHS) + NEW)
    requests = [sched.submit(p, NEW, eos_ids=(eos,)) for p in prompts]
    while sched.has_work:
        sched.step()
    for req, ref in zip(requests, alone):
        expect = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert req.output == expect
        assert req.finish_reason == ("stop" if eos in ref else "length")
    assert requests[0].finish_reason == "stop" and len(requests[0].output) == 4


def test_cancel_ends_one_request_and_leaves_the_others_alone(engine, prompts, alone):
    sched = Scheduler(engine, 2, max(LENGTHS) + NEW)
    requests = [sched.submit(p, NEW) for p in prompts[:4]]
    for _ in range(3):
        sched.step()
    victim, queued = requests[1], requests[3]
    sched.cancel(victim)
    sched.cancel(queued)  # still waiting: it never runs
    events = sched.step()
    assert (victim, None) in events and (queued, None) in events
    assert victim.finish_reason == queued.finish_reason == "cancelled"
    assert queued.output == [] and victim.output == alone[1][: len(victim.output)]
    while sched.has_work:
        sched.step()
    assert requests[0].output == alone[0] and requests[2].output == alone[2]


def test_submit_refuses_what_cannot_run(engine):
    sched = Scheduler(engine, 1, 16)
    for bad, fragment in (([], "empty"), ([5, 1000], "outside the vocab"), ([1] * 10, "over the 16 positions"),
                          (torch.tensor([1, 2]), "a list of token ids \\(ints\\), got Tensor"), ("hello", "got str"),
                          ([1.0, 2.0], "position 0 of the prompt is 1.0, not an int"), ([True], "is True, not an int")):
        with pytest.raises(ValueError, match=fragment):
            sched.submit(bad, 7)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got 2.0"):
        sched.submit([1], 2.0)
    sched.close()
    # generate's own sizes come from the prompt: a bad one is named as submit names it.
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(engine, [], 3)
    with pytest.raises(ValueError, match="no prompts"):
        generate_batch(engine, [], 3)
    with pytest.raises(ValueError, match="closed"):
        sched.submit([1], 1)
    # Past the positions the model was made for, as serve's --max-len and the CLI refuse them.
    limit = engine.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_len {limit + 2} would read {limit + 1} positions, over the model's max_position_embeddings \\({limit}\\)"):
        Scheduler(engine, 1, limit + 2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(engine, [1, 2], limit + 1)


def test_bench_batch_counts_every_sequence(engine):
    from pocketllm.engine.timing import timed_batch

    r = timed_batch(engine, [prompt(20, i) for i in range(3)], 4, lambda: None)
    assert (r["batch"], r["prefill_tokens"], r["decode_tokens"]) == (3, 60, 12)
    assert r["decode_tokens_per_s"] == pytest.approx(3 * r["decode_tokens_per_s_per_sequence"])


def test_bad_batch_flags_are_usage_errors(capsys):
    usage_error_in_process(capsys, "bench", "--preset", "tiny", "--batch", "0", expect="--batch must be >= 1")
    usage_error_in_process(
        capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--token-ids", "3", "--stream", expect="--stream takes one prompt, got 2"
    )
    usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1", "--max-running", "0", expect="--max-running must be >= 1")


def test_prompts_file_lines_are_checked(capsys, tiny_ckpt, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("one\n\nthree\n")
    usage_error_in_process(capsys, "generate", "--ckpt", tiny_ckpt, "--prompts-file", path, expect="line 2 is empty")


def test_a_prompts_files_texts_are_text_lines_however_many_it_holds(capsys, tiny_ckpt, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("one\n")
    capsys.readouterr()
    assert main_in_process("generate", "--ckpt", tiny_ckpt, "--prompts-file", path, "--max-new-tokens", 3) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("generated_ids=") and lines[1].startswith("text=\""), lines


def test_a_batch_at_tp2_matches_transformers(tmp_path):
    model = build_hf_model(vocab=251, kv_heads=1, tie=False)
    ckpt = save_hf_checkpoint(model, tmp_path / "ckpt")
    # No id 0: transformers would take it for padding (pad_token_id=0 in hf_greedy) and mask it.
    batch = [[(11 * i + 3 * j) % 250 + 1 for i in range(n)] for j, n in enumerate((9, 1, 70, 4))]
    args = [a for p in batch for a in ("--token-ids", ",".join(map(str, p)))]
    r = run_cli(
        "generate", "--ckpt", ckpt, "--tp-world", 2, "--dtype", "float32", *args, "--max-new-tokens", 6,
        "--max-running", 3, "--dist-timeout", 30,
    )
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("generated_ids=")]
    assert [generated_ids(line) for line in lines] == [hf_greedy(model, p, 6) for p in batch]


def test_a_bf16_decode_step_of_several_rows_runs_the_few_row_kernels(monkeypatch, tmp_path):
    # bf16 on a CPU: reserving slots measures the few-row kernels (the compiled ones among them),
    # and a decode step of four sequences through them gives each sequence's logits within bf16
    # rounding of its own one-row step.
    from pocketllm import compiled
    from pocketllm.switches import ENV_KERNELS

    monkeypatch.setenv(compiled.ENV_CACHE_DIR, str(tmp_path))
    # Measured, whatever a developer has forced.
    monkeypatch.delenv(ENV_KERNELS, raising=False)
    eng = tiny_engine(torch.bfloat16)
    eng.reserve_slots(4, 40)
    few = {c.rows: c for c in eng.kernels.choices if c.kind.rows == "few-row"}
    # Measured (cached or not, as the machine was quiet or not).
    assert sorted(few) == [2, 4] and all(c.how.startswith("measured") for c in few.values())
    assert {"c", "mm"} <= set(next(iter(few[4].seconds.values())))
    prompts = [prompt(6 + 3 * i, i) for i in range(4)]
    eng.run_packed([(s, 0, torch.tensor(p)) for s, p in enumerate(prompts)])
    step = eng.run_packed([(s, len(p), torch.tensor([s + 1])) for s, p in enumerate(prompts)])
    # The layer was bound to the few-row choices when the slots were reserved (to what runs
    # instead where the measured one-row kernel is one no few-row kernel sums like).
    down = eng.model.layers[0].mlp.down
    assert down.kernels.names["4-row"] == eng.kernels.runs(few[4], down.weight)
    for s, p in enumerate(prompts):
        feed(eng, p)
        alone = feed(eng, [s + 1], len(p))
        assert (step[s] - alone).abs().max().item() <= 0.05 * alone.abs().max().item()

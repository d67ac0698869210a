"""One generation loop: generate, bench and serve's engine driver produce every token inside the
Scheduler's step, and the model commands' decode rows take the direct step (the decode-step
backend) under the hooks every command runs with."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import ServePair, main_in_process, tiny_engine

from pocketllm.commands.make_checkpoint import write_byte_tokenizer
from pocketllm.engine.runner import Engine
from pocketllm.engine.sampling import SamplingParams
from pocketllm.engine.scheduler import Scheduler
from pocketllm.inputs import load_tokenizer
from pocketllm.serving.generation import Usage, pieces
from pocketllm.serving.text import OutputText

# A compiled one-row kernel for every weight, so the tiny preset's bf16 decode step is one call.
COMPILED = "one-row=c-prefetch"


class LoopWatch:
    """Counts Scheduler steps, and fails any engine pass or decode row run outside one."""

    def __init__(self, monkeypatch):
        self.steps, self.inside, self.outside = 0, 0, []
        step, run_packed, greedy_row = Scheduler.step, Engine.run_packed, Engine.greedy_row

        def counted_step(sched):
            self.steps += 1
            self.inside += 1
            try:
                return step(sched)
            finally:
                self.inside -= 1

        def watched(fn, name):
            def call(engine, *args, **kwargs):
                if not self.inside:
                    self.outside.append(name)
                return fn(engine, *args, **kwargs)

            return call

        monkeypatch.setattr(Scheduler, "step", counted_step)
        monkeypatch.setattr(Engine, "run_packed", watched(run_packed, "run_packed"))
        monkeypatch.setattr(Engine, "greedy_row", watched(greedy_row, "greedy_row"))


@pytest.mark.timeout(120)
def test_generate_and_bench_make_every_pass_inside_the_loop_and_bench_takes_the_direct_step(monkeypatch, capsys):
    monkeypatch.setenv("POCKETLLM_KERNELS", COMPILED)
    watch = LoopWatch(monkeypatch)
    assert main_in_process("generate", "--preset", "tiny", "--token-ids", "1,2,3,4", "--max-new-tokens", 5) == 0
    assert watch.steps >= 5 and watch.outside == []
    generated = capsys.readouterr().out
    steps = watch.steps
    rc = main_in_process("bench", "--preset", "tiny", "--prompt-tokens", 16, "--max-new-tokens", 6, "--warmup-tokens", 4)
    assert rc == 0
    out, err = capsys.readouterr()
    assert watch.steps >= steps + 7 and watch.outside == []
    # The bench's line says what ran its timed decode steps: every one the direct step.
    assert "decode step: one compiled call" in err
    assert out.strip().endswith("decode_step=direct"), out
    assert "generated_ids=" in generated


@pytest.mark.timeout(60)
def test_serves_driver_makes_every_pass_inside_the_loop(monkeypatch, tmp_path):
    write_byte_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(str(tmp_path))
    watch = LoopWatch(monkeypatch)
    engine = tiny_engine()
    pair = ServePair(Scheduler(engine, max_running=2, max_len=64))
    pair.start()
    try:

        async def both():
            async def one(prompt):
                seq = pair.submit(prompt, 6, SamplingParams(), ())
                return [t for p in [p async for p in pieces(seq, OutputText(tokenizer, ()), Usage(len(prompt)))] for t in p.token_ids]

            return await asyncio.gather(one([5, 6, 7]), one([8, 9]))

        answers = asyncio.run(both())
    finally:
        pair.begin_shutdown()
        assert pair.join(10)
    assert [len(a) for a in answers] == [6, 6]
    assert watch.steps >= 6 and watch.outside == []


def test_a_lone_greedy_row_goes_to_the_step_from_the_loop(monkeypatch):
    # The scheduler hands a pass that is one sequence's greedy decode row to the engine's decode
    # row (the direct step where there is one), and its tokens are the whole pass's argmax.
    monkeypatch.setenv("POCKETLLM_KERNELS", COMPILED)
    engine = tiny_engine(torch.bfloat16)
    assert engine.step is not None
    sched = Scheduler(engine, 1, 64, lockstep=True)
    req = sched.submit([3, 1, 4, 1, 5], 8)
    before = engine.direct_steps
    while sched.has_work:
        sched.step()
    assert engine.direct_steps - before == 7
    engine.step = None
    sched = Scheduler(engine, 1, 64, lockstep=True)
    plain = sched.submit([3, 1, 4, 1, 5], 8)
    while sched.has_work:
        sched.step()
    assert req.output == plain.output

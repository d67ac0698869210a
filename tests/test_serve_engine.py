"""serve's engine driver and the HTTP side's client in process, linked as serve links them, on the real Scheduler over a tiny fp32 engine at TP=1: an eos id
ends an answer (counted, not shown), a stop string cancels its request and frees the slot, a
shutdown ends every request with an error, closes the scheduler and stops the thread, and an
engine that fails ends every request with a 500 and tells the server to stop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import ServePair, tiny_engine

from pocketllm.commands.make_checkpoint import write_byte_tokenizer
from pocketllm.engine.generate import generate
from pocketllm.engine.sampling import SamplingParams
from pocketllm.engine.scheduler import Scheduler
from pocketllm.fault_injection import Fault, FaultHook
from pocketllm.inputs import load_tokenizer
from pocketllm.serving.errors import ApiError
from pocketllm.serving.generation import Usage, pieces
from pocketllm.serving.text import OutputText

PROMPT = [72, 101, 108, 108, 111]
NEW = 24


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytes")
    write_byte_tokenizer(d / "tokenizer.json")
    return load_tokenizer(str(d))


@pytest.fixture
def loop(engine):
    # Room for a long request beside the short ones.
    lp = ServePair(Scheduler(engine, max_running=4, max_len=512))
    lp.start()
    yield lp
    lp.begin_shutdown()
    assert lp.join(10)


async def answer(loop: ServePair, tokenizer, prompt, new, eos=(), stop=()):
    seq = loop.submit(prompt, new, SamplingParams(), eos)
    usage = Usage(len(prompt))
    got = [p async for p in pieces(seq, OutputText(tokenizer, stop), usage)]
    return "".join(p.text for p in got), [t for p in got for t in p.token_ids], got[-1].finish_reason, usage


@pytest.mark.timeout(60)
def test_an_eos_id_ends_the_answer_counted_but_not_shown(engine, loop, tokenizer):
    alone = generate(engine, PROMPT, NEW)
    # A byte token, so that it would show were it not left out.
    at = next(i for i, t in enumerate(alone) if t < 256 and i > 2 and t not in alone[:i])
    eos = alone[at]
    text, ids, reason, usage = asyncio.run(answer(loop, tokenizer, PROMPT, NEW, eos=(eos,)))
    assert ids == alone[: at + 1] and reason == "stop" and usage.completion_tokens == at + 1
    assert text == tokenizer.decode(alone[:at])


@pytest.mark.timeout(60)
def test_a_stop_string_cancels_the_request_and_frees_its_slot(engine, loop, tokenizer):
    alone = generate(engine, PROMPT, NEW)
    full = tokenizer.decode(alone)
    stop = full[len(full) // 2 :][:2]
    # Room for far more tokens than the stop string needs: the request must end long before.
    text, _, reason, _ = asyncio.run(answer(loop, tokenizer, PROMPT, 480, stop=(stop,)))
    assert (text, reason) == (full[: full.index(stop)], "stop")
    # The cancel takes effect at the next step.
    deadline = time.monotonic() + 5
    while loop.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.scheduler.num_running == 0 and not loop.scheduler.has_work
    # Counted as its answer ended (vLLM's finished_reason), not as a client that left.
    assert loop.metrics.ended == {"stop": 1} and loop.metrics.generated_tokens < 480


def test_a_stop_string_the_last_token_completes_is_counted_as_stop(engine, loop, tokenizer):
    """The engine ends the request on length at the very token whose text completes the stop
    string: the answer says stop, and so does /metrics (it counted the engine's length)."""
    alone = generate(engine, PROMPT, NEW)
    for k in range(NEW, 0, -1):
        text, before = tokenizer.decode(alone[:k]), tokenizer.decode(alone[: k - 1])
        if len(text) > len(before) and text[-1] not in before:
            break
    else:
        pytest.fail(f"no token adds a character not shown before: {alone}")
    got, _, reason, _ = asyncio.run(answer(loop, tokenizer, PROMPT, k, stop=(text[-1],)))
    assert (got, reason) == (before, "stop")
    assert loop.metrics.ended == {"stop": 1}


@pytest.mark.timeout(60)
def test_a_shutdown_ends_every_request_with_an_error_and_closes_the_scheduler(loop, tokenizer):
    async def run():
        long = asyncio.ensure_future(answer(loop, tokenizer, PROMPT, 500))
        waiting = [asyncio.ensure_future(answer(loop, tokenizer, PROMPT, 400)) for _ in range(5)]
        while loop.metrics.generated_tokens < 10:
            await asyncio.sleep(0.01)
        loop.begin_shutdown()
        results = await asyncio.gather(long, *waiting, return_exceptions=True)
        with pytest.raises(ApiError) as refused:
            loop.submit(PROMPT, 4, SamplingParams(), ())
        return results, refused.value

    results, refused = asyncio.run(run())
    # Running or still waiting for a slot (five of the six fit), each ends with the 503.
    assert all(isinstance(r, ApiError) and r.status == 503 for r in results), results
    assert refused.status == 503
    assert loop.join(10) and loop.scheduler.closed and not loop.scheduler.has_work


class _LostPeer:
    """A pass whose all-reduce finds the other rank gone, as gloo says it."""

    watches_layers = False

    def before_pass(self, info) -> None:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")

    def after_pass(self, info) -> None:
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["raise", "lost-peer"])
def test_an_engine_failure_ends_every_request_with_a_500_and_stops_the_server(engine, tokenizer, failure):
    stopped = []
    lp = ServePair(Scheduler(engine, max_running=2, max_len=512), on_end=lambda: stopped.append(True))
    # The test-only fault injection (POCKETLLM_FAULT's hook): the first decode pass raises. A lost
    # peer is said as the launcher says it for a rank, not in the backend's own words.
    hook = FaultHook(Fault(0, "decode", "raise"), 0) if failure == "raise" else _LostPeer()
    said = "injected fault" if failure == "raise" else "rank 0: lost its connection to another rank in "
    engine.hooks.append(hook)
    try:
        lp.start()

        async def run():
            return await asyncio.gather(*(answer(lp, tokenizer, PROMPT, 50) for _ in range(3)), return_exceptions=True)

        results = asyncio.run(run())
        assert lp.join(10)
    finally:
        engine.hooks.remove(hook)
    assert all(isinstance(r, ApiError) and r.status == 500 and said in r.message and "gloo" not in r.message for r in results), results
    assert stopped == [True] and isinstance(lp.failure, RuntimeError)
    with pytest.raises(ApiError) as refused:
        asyncio.run(_submit(lp))
    assert refused.value.status == 500


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ending", ["failed", "closed"])
def test_a_request_submitted_as_the_engine_ends_is_answered_not_left_waiting(ending, monkeypatch):
    """The link's reader thread ends every open request when the engine fails or closes; a request
    submitted on the event loop at that moment (here: while it is checked) is refused, or ended
    with the others, never left waiting for an engine that reads no more (the lost-peer test above
    hung so once in CI)."""
    import socket

    from pocketllm.serving import engine_client, wire
    from pocketllm.serving.metrics import Metrics

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = engine_client.EngineClient(theirs, Metrics(), 1000, 64)
    message = (wire.FAILED, "rank 0: lost") if ending == "failed" else (wire.CLOSED,)
    real = engine_client.request_problem

    def meanwhile(*args):
        client._handle(message)  # as the reader thread would, between the checks and the registration
        return real(*args)

    async def run():
        with monkeypatch.context() as m:
            m.setattr(engine_client, "request_problem", meanwhile)
            with pytest.raises(ApiError) as refused:
                client.submit([1, 2], 4, SamplingParams(), ())
        return refused.value

    try:
        refused = asyncio.run(run())
        assert refused.status == (500 if ending == "failed" else 503), refused

        # One registered before a close the engine never answered (sent after it stopped reading).
        if ending == "closed":
            client2 = engine_client.EngineClient(theirs, Metrics(), 1000, 64)

            async def orphaned():
                seq = client2.submit([1, 2], 4, SamplingParams(), ())
                client2._handle((wire.CLOSED,))
                return await asyncio.wait_for(seq.next(), 5)

            event = asyncio.run(orphaned())
            assert event.error is not None and event.error.status == 503, event
    finally:
        ours.close()
        theirs.close()


@pytest.mark.timeout(60)
def test_a_request_whose_token_cannot_be_chosen_ends_alone_and_the_rest_go_on(engine, tokenizer, monkeypatch, capfd):
    """A sampler error in one request (here made by wrapping the scheduler's choose) ends that
    request with a 500 naming it; the requests beside it get the tokens they get alone, and the
    server keeps serving."""
    import pocketllm.engine.scheduler as scheduler_module

    real = scheduler_module.choose

    def choose(logits, sampling, *args):
        if sampling.seed == 666:
            raise OverflowError("the draw failed\nsecond line")
        return real(logits, sampling, *args)

    monkeypatch.setattr(scheduler_module, "choose", choose)
    stopped = []
    lp = ServePair(Scheduler(engine, max_running=4, max_len=512), on_end=lambda: stopped.append(True))
    lp.start()
    bad = SamplingParams(temperature=0.8, seed=666)
    good = SamplingParams(temperature=0.8, seed=7)

    async def sampled(sampling):
        seq = lp.submit(PROMPT, NEW, sampling, ())
        got = [p async for p in pieces(seq, OutputText(tokenizer, ()), Usage(len(PROMPT)))]
        return [t for p in got for t in p.token_ids]

    async def run():
        return await asyncio.gather(answer(lp, tokenizer, PROMPT, NEW), sampled(bad), sampled(good), return_exceptions=True)

    try:
        greedy, failed, drawn = asyncio.run(run())
        after = asyncio.run(answer(lp, tokenizer, PROMPT, NEW))
    finally:
        lp.begin_shutdown()
        assert lp.join(10)
    assert isinstance(failed, ApiError) and failed.status == 500, failed
    assert failed.message == "the engine could not finish this request: OverflowError: the draw failed", failed.message
    assert greedy[1] == generate(engine, PROMPT, NEW) and after[1] == greedy[1]
    assert drawn == generate(engine, PROMPT, NEW, sampling=good)
    assert lp.failure is None and stopped == [True]  # the end is the shutdown's, not a failure's
    assert lp.metrics.ended.get("error") == 1
    assert "request 1 failed choosing its token (OverflowError: the draw failed); the others go on" in capfd.readouterr().err


async def _submit(lp):
    return lp.submit(PROMPT, 4, SamplingParams(), ())


@pytest.mark.timeout(30)
def test_the_http_process_gone_closes_the_scheduler_and_says_so(engine):
    import socket

    from pocketllm.serving.engine_driver import EngineDriver

    from pocketllm.serving import wire

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    scheduler = Scheduler(engine, max_running=2, max_len=512)
    driver = EngineDriver(scheduler, ours)
    thread = threading.Thread(target=driver.run, daemon=True)
    thread.start()
    # The driver's first message (the pool's gauges) arrives; then, while it waits idle for work,
    # the HTTP side's end closes: what it sees is its link at end of file, not a failed send.
    assert wire.Receiver(theirs).one()[0] == wire.EVENTS
    theirs.close()
    thread.join(10)
    assert not thread.is_alive(), "the driver kept waiting on a closed link"
    assert driver.lost and scheduler.closed and driver.summary() == "engine: no step ran"


@pytest.mark.timeout(60)
def test_a_prompt_whose_logits_are_not_finite_ends_alone_with_an_error_naming_it(engine, tokenizer, monkeypatch):
    """Not finite logits at a request's first token (corrupt weights make them NaN; argmax would
    then pick token 0 for ever) end that request with a 500 saying so; the others go on."""
    import torch

    poisoned = [9, 9, 9]
    real = Scheduler._run

    def run(self, spans, fed, keep):
        logits = real(self, spans, fed, keep).clone()
        for row, req in enumerate(fed[:len(logits)]):
            if req.prompt == poisoned:
                logits[row] = float("nan")
        return logits

    monkeypatch.setattr(Scheduler, "_run", run)
    lp = ServePair(Scheduler(engine, max_running=4, max_len=512))
    lp.start()

    async def both():
        return await asyncio.gather(answer(lp, tokenizer, poisoned, NEW), answer(lp, tokenizer, PROMPT, NEW), return_exceptions=True)

    try:
        failed, fine = asyncio.run(both())
    finally:
        lp.begin_shutdown()
        assert lp.join(10)
    assert isinstance(failed, ApiError) and failed.status == 500 and "logits for the prompt are not finite" in failed.message, failed
    assert not isinstance(fine, BaseException) and len(fine[1]) == NEW and torch.isfinite(torch.tensor(fine[1])).all()


def test_the_pools_gauges_sent_beside_the_settings_reach_metrics_before_any_request():
    """The HTTP side's first read can take the settings and the engine's first gauges at once; the
    gauges must not wait in the reader's buffer for the next message (an idle server's /metrics
    had no KV series until its first request)."""
    import socket

    from pocketllm.serving import wire
    from pocketllm.serving.engine_client import EngineClient
    from pocketllm.serving.metrics import Metrics

    engine_end, http_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    import dataclasses

    from pocketllm.engine.request import KVUsage

    gauges = (0, 0, dataclasses.asdict(KVUsage(blocks_total=64, blocks_used=0, block_size=16, preemptions=0)))
    wire.send(engine_end, (wire.SETTINGS, {}))
    wire.send(engine_end, (wire.EVENTS, [], gauges))
    receiver = wire.Receiver(http_end)
    assert receiver.one()[0] == wire.SETTINGS
    client = EngineClient(http_end, Metrics(), 1000, 512, receiver)
    client.start()
    try:
        deadline = time.monotonic() + 5
        while client.gauges != gauges and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.gauges == gauges
    finally:
        engine_end.close()
        client.ended.wait(5)
        http_end.close()

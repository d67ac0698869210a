"""gloo ranks wait for a collective by polling its work handle; NCCL/HCCL ranks, and gloo ranks
with POCKETLLM_POLL_COLLECTIVES=0, block in work.wait(). The multi-rank tests elsewhere run with
polling on (the default) and check results against one rank; a TP=2 bench with polling off:
test_cpu_pinning."""

from __future__ import annotations

import pytest

from pocketllm.distributed import waiting
from pocketllm.errors import UsageError


@pytest.mark.parametrize(
    "backend,env,expected",
    [("gloo", {}, True), ("gloo", {"POCKETLLM_POLL_COLLECTIVES": "0"}, False), ("gloo", {"POCKETLLM_POLL_COLLECTIVES": "on"}, True),
     ("nccl", {}, False), ("hccl", {}, False)],
    ids=["gloo", "gloo-off", "gloo-on", "nccl", "hccl"],
)
def test_only_gloo_polls_unless_turned_off(backend, env, expected):
    assert waiting.polls_on(backend, env) is expected


def test_a_bad_switch_value_is_refused():
    with pytest.raises(UsageError, match="POCKETLLM_POLL_COLLECTIVES='sometimes' is not a switch"):
        waiting.polls_on("gloo", {"POCKETLLM_POLL_COLLECTIVES": "sometimes"})


class FakeWork:
    """Done after `polls` calls of is_completed; wait() raises `error` if given."""

    def __init__(self, polls: int, error: Exception | None = None):
        self.polls, self.error = polls, error
        self.checked = self.waited = 0

    def is_completed(self) -> bool:
        self.checked += 1
        return self.checked > self.polls

    def wait(self) -> bool:
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


@pytest.fixture
def restore_waiting():
    saved = waiting.polling()
    yield
    waiting._poll = saved


def test_polling_waits_until_done_and_then_takes_the_outcome(restore_waiting):
    waiting.configure("gloo", {})
    work = FakeWork(polls=3)
    waiting.wait(work)
    assert (work.checked, work.waited) == (4, 1)
    # A failed collective completes with its error: polling stops and the error is raised.
    failed = FakeWork(polls=2, error=RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        waiting.wait(failed)
    assert failed.checked == 3


def test_blocking_backends_never_poll(restore_waiting):
    waiting.configure("nccl", {})
    work = FakeWork(polls=3)
    waiting.wait(work)
    assert (work.checked, work.waited) == (0, 1)


def test_every_engine_collective_is_waited_for_by_polling(restore_waiting, monkeypatch):
    # The all-reduce (serial and overlapped), the head's all-gather and the token broadcast each
    # hand their work handle to waiting.wait, with no real group: torch.distributed's calls are
    # replaced by ones that return a handle and record the call.
    import torch
    import torch.distributed as dist

    from pocketllm.distributed import state
    from pocketllm.distributed.overlap import projection_all_reduce_overlapped
    from pocketllm.ops.registry import default_kernels

    issued, waited = [], []

    def fake(name):
        def call(*args, async_op=False, **kwargs):
            assert async_op, f"{name} issued blocking"
            issued.append(name)
            return FakeWork(polls=0)

        return call

    for name in ("all_reduce", "all_gather", "broadcast"):
        monkeypatch.setattr(dist, name, fake(name))
    monkeypatch.setattr(waiting, "wait", lambda work: waited.append(work))
    monkeypatch.setattr(state, "_TP", state.TPState(0, 2))
    x, w = torch.ones(4, 8), torch.ones(3, 8)
    projection_all_reduce_overlapped(x, default_kernels(w), 1, "mlp.down")  # serial
    projection_all_reduce_overlapped(x, default_kernels(w), 2, "mlp.down")  # two slices
    state.all_gather_cat(torch.ones(1, 3))
    state.broadcast_(torch.zeros(1, dtype=torch.long))
    assert issued == ["all_reduce", "all_reduce", "all_reduce", "all_gather", "broadcast"]
    assert len(waited) == len(issued)

"""gloo ranks wait for a collective by polling its work handle; NCCL/HCCL ranks, and gloo ranks
with POCKETLLM_POLL_COLLECTIVES=0, block in work.wait(). Both must give the same results."""

from __future__ import annotations

import pytest

from conftest import cli_env, generated_ids, run_cli, usage_error_in_process
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


@pytest.mark.timeout(120)
def test_polled_and_blocking_ranks_generate_the_same_tokens():
    # TP=2 with two overlap slices, so the async all-reduces of the overlapped path are waited for too.
    argv = ("generate", "--preset", "tiny", "--tp-world", 2, "--token-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", 6,
            "--pin-slices", 2, "--dtype", "float32")
    runs = {}
    for value in ("1", "0"):
        r = run_cli(*argv, env=cli_env(POCKETLLM_POLL_COLLECTIVES=value))
        assert r.returncode == 0, r.stderr
        runs[value] = generated_ids(r.stdout)
    assert runs["1"] == runs["0"] and len(runs["1"]) == 6


def test_bad_poll_switch_is_a_usage_error_before_any_rank_starts(capsys, no_ranks, monkeypatch):
    monkeypatch.setenv("POCKETLLM_POLL_COLLECTIVES", "maybe")
    line = usage_error_in_process(capsys, "generate", "--preset", "tiny", "--token-ids", "1,2", "--tp-world", "2")
    assert "POCKETLLM_POLL_COLLECTIVES='maybe' is not a switch" in line, line

"""gloo ranks wait for a collective by polling its work handle; NCCL/HCCL ranks, and gloo ranks
with POCKETLLM_POLL_COLLECTIVES=0, block in work.wait(). The multi-rank tests elsewhere run with
polling on (the default) and check results against one rank."""

from __future__ import annotations

import json

import pytest

from conftest import cli_env, run_cli
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
@pytest.mark.parametrize("value,polls", [("1", True), ("0", False)], ids=["on", "off"])
def test_gloo_ranks_poll_unless_turned_off(value, polls, tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "--preset", "tiny", "--tp-world", 2, "--prompt-tokens", 16, "--max-new-tokens", 2, "--json", out,
                env=cli_env(POCKETLLM_POLL_COLLECTIVES=value))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["settings"]["polls_collectives"] is polls

"""pocketllm.startup: in a process pocketllm's entry started, the imports run with the cyclic
collector paused and what they made is frozen out of its reach; called inside another program's
process (as here, unless told otherwise), the collector is left as it is."""

from __future__ import annotations

import gc

import pytest

from pocketllm import startup


@pytest.fixture
def collector():
    """The collector as this process had it, restored after the test: on or off as it was, and
    nothing frozen (the suite's process freezes nothing of its own: it is not one pocketllm owns)."""
    was_on = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was_on else gc.disable)()


class _Made:
    """An object the block makes and keeps."""


def test_an_owned_process_imports_with_the_collector_paused_and_freezes_what_they_made(collector, monkeypatch):
    monkeypatch.setattr(startup, "_owned", True)
    gc.enable()
    seen_on = []
    with startup.importing():
        seen_on.append(gc.isenabled())
        kept = [_Made() for _ in range(1000)]
    assert seen_on == [False] and gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)
    # A collector the caller had turned off stays off.
    gc.disable()
    with startup.importing():
        pass
    assert not gc.isenabled()


def test_inside_another_programs_process_the_collector_is_left_alone(collector, monkeypatch):
    monkeypatch.setattr(startup, "_owned", False)
    gc.enable()
    gc.unfreeze()
    with startup.importing():
        assert gc.isenabled()
        [_Made() for _ in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_ranks_imports_leave_out_torchs_compiler_stack():
    """What a rank imports before its work (commands.on_rank: the engine, the layers, every op)
    does not bring in torch._dynamo, which costs over half a second of a core in every process
    (a module-level import of torch.nn.attention.bias once did)."""
    import subprocess
    import sys

    probe = "import sys, pocketllm.commands.on_rank; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_a_process_knows_how_long_ago_it_started():
    """seconds_since_start counts from the process's start (the interpreter's start and imports
    included): bench's ready time stands on it."""
    import subprocess
    import sys
    import time

    probe = "import time; time.sleep(0.3); from pocketllm.startup import seconds_since_start; print(seconds_since_start())"
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    wall = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    # The kernel counts in clock ticks (10 ms here): allow one either side.
    assert 0.3 - 0.011 <= float(done.stdout) <= wall + 0.011, (done.stdout, wall)

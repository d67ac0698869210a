"""`pocketllm serve`'s own usage errors: one line, exit 2, before any rank starts."""

from __future__ import annotations

import dataclasses
import socket

import pytest
from conftest import main_in_process, usage_error_in_process

from pocketllm.commands import serve


@pytest.mark.parametrize("args,expect", [
    (["--preset", "tiny"], "serve needs a checkpoint with tokenizer.json"),
    (["--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["--max-running", "0"], "--max-running must be >= 1, got 0"),
    (["--prefill-budget", "0"], "--prefill-budget must be >= 1, got 0"),
    (["--max-len", "1"], "--max-len must be in 2..32768"),
    (["--max-len", "40000"], "--max-len must be in 2..32768"),
    (["--api-key", " "], "--api-key (or POCKETLLM_API_KEY) must not be empty"),
    (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: cannot resolve"),
    # Sizes past anything a pass or the host could hold: one line, not an allocation's traceback.
    (["--kv-cache-gib", "inf"], "--kv-cache-gib must be a number > 0, got inf"),
    (["--max-running", "100000000"], "the sequences' linear-attention state (--max-running 100000000: "),
    (["--kv-cache-gib", "1000000"], "and the KV pool (--kv-cache-gib 1e+06) per rank take"),
    (["--allowed-origins", "http://a.example,localhost:3000"], "--allowed-origins: 'localhost:3000' is not an origin"),
    (["--allowed-origins", "https://a.example/app"], "--allowed-origins: 'https://a.example/app' is not an origin"),
], ids=["preset", "port", "max-running", "prefill-budget", "max-len-small", "max-len-big", "api-key", "host", "kv-inf",
        "slots-past-host", "pool-past-host", "origin-no-scheme", "origin-path"])
def test_bad_flags_are_one_line(capsys, no_ranks, tiny_ckpt, args, expect):
    ckpt = [] if args[0] == "--preset" else ["--ckpt", tiny_ckpt]
    usage_error_in_process(capsys, "serve", *ckpt, *args, "--tp-world", 2, expect=expect)


def test_a_port_in_use_is_refused_before_loading(capsys, no_ranks, tiny_ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        usage_error_in_process(capsys, "serve", "--ckpt", tiny_ckpt, "--port", port, "--tp-world", 2, expect=f"cannot listen on 127.0.0.1:{port}")


def test_a_slots_linear_attention_state_is_sized_as_the_layers_allocate_it():
    """What the launcher counts per --max-running slot (torch-free) is what the layers allocate
    for one; split over ranks, each holds its share of the heads."""
    import torch

    from pocketllm.distributed.policy import RulePolicy
    from pocketllm.distributed.state import set_tp
    from pocketllm.engine.runner import Engine
    from pocketllm.layers.kv_layout import gdn_slot_bytes
    from pocketllm.loader.random_weights import RandomWeights
    from pocketllm.presets import get_preset

    cfg = get_preset("tiny")
    set_tp(0, 1)  # one rank in this process, whatever an earlier in-process rank left
    engine = Engine(cfg, RandomWeights(cfg, dtype=torch.bfloat16), torch.bfloat16, torch.device("cpu"), RulePolicy())
    layers = [m for m in engine.model.modules() if hasattr(m, "allocate_states") and hasattr(m, "hv")]
    assert layers and sum(m.state_bytes() for m in layers) == gdn_slot_bytes(cfg, 1, 2)
    assert 2 * gdn_slot_bytes(cfg, 2, 2) == gdn_slot_bytes(cfg, 1, 2)


def test_a_prefill_budget_past_every_slots_length_is_held_to_it(capsys, tiny_ckpt, monkeypatch):
    """A pass's rows are allocated at start: a budget past --max-running x --max-len (which no
    pass can read) is held to that, not allocated (10**10 rows took 80 GB, and failed)."""
    from pocketllm.engine import scheduler
    from pocketllm.errors import UsageError

    seen = []

    def stop_at_the_scheduler(self, engine, max_running, max_len, prefill_budget, **kw):
        seen.append(prefill_budget)
        raise UsageError("stopped before serving")

    monkeypatch.setattr(scheduler.Scheduler, "__init__", stop_at_the_scheduler)
    assert main_in_process("serve", "--ckpt", tiny_ckpt, "--max-running", 2, "--max-len", 100, "--prefill-budget", 10**10, "--port", 0) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "pocketllm: error: stopped before serving"
    assert seen == [200]


def test_a_checkpoint_without_a_chat_template_is_said_at_start(capsys, no_ranks, ckpt_copy):
    (ckpt_copy / "tokenizer_config.json").unlink()
    # Stopped by a bad port right after: the note comes from the checks before any rank starts.
    assert main_in_process("serve", "--ckpt", ckpt_copy, "--port", 70000, "--tp-world", 2) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("pocketllm: note: the checkpoint has no chat template") and "/v1/completions serves" in lines[0]
    assert lines[1] == "pocketllm: error: --port must be in 0..65535, got 70000"


def test_listening_beyond_this_machine_without_a_key_is_said():
    from pocketllm.serving.server import exposure_note

    for host in ("0.0.0.0", "::", "192.168.1.5", "myhost"):
        assert "with no API key" in exposure_note(host, None), host
        assert exposure_note(host, "k") is None
    for host in ("127.0.0.1", "::1", "127.0.0.2"):
        assert exposure_note(host, None) is None, host


def test_every_flag_reaches_the_servers_settings(monkeypatch, tiny_ckpt):
    """Each of serve's flags, at a value other than its default, is the one its run plan holds
    (--reasoning-parser was parsed and then left out, so it did nothing)."""
    given = dict(host="127.0.0.2", port=8123, max_running=3, max_len=96, prefill_budget=77, kv_cache_gib=0.5,
                 enable_prefix_caching=False, api_key="k", served_model_name="m", generation_config="none", reasoning_parser="qwen3",
                 allowed_origins="http://localhost:3000")
    assert set(given) == {f.name for f in dataclasses.fields(serve.Task)}
    assert all(getattr(serve.Task(), k) != v for k, v in given.items())
    plans = []
    monkeypatch.setattr(serve, "execute", lambda plan: plans.append(plan) or 0)
    argv = ["--no-enable-prefix-caching" if k == "enable_prefix_caching" else f"--{k.replace('_', '-')}={v}"
            for k, v in given.items()]
    assert main_in_process("serve", "--ckpt", tiny_ckpt, *argv) == 0
    assert plans[0].task == serve.Task(**given)

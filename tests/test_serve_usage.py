"""`pocketllm serve`'s own usage errors: one line, exit 2, before any rank starts."""

from __future__ import annotations

import socket

import pytest
from conftest import usage_error_in_process


@pytest.mark.parametrize("args,expect", [
    (["--preset", "tiny"], "serve needs a checkpoint with tokenizer.json"),
    (["--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["--max-running", "0"], "--max-running must be >= 1, got 0"),
    (["--prefill-budget", "0"], "--prefill-budget must be >= 1, got 0"),
    (["--max-len", "1"], "--max-len must be in 2..32768"),
    (["--max-len", "40000"], "--max-len must be in 2..32768"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: cannot resolve"),
], ids=["preset", "port", "max-running", "prefill-budget", "max-len-small", "max-len-big", "api-key", "host"])
def test_bad_flags_are_one_line(capsys, no_ranks, tiny_ckpt, args, expect):
    ckpt = [] if args[0] == "--preset" else ["--ckpt", tiny_ckpt]
    usage_error_in_process(capsys, "serve", *ckpt, *args, "--tp-world", 2, expect=expect)


def test_a_port_in_use_is_refused_before_loading(capsys, no_ranks, tiny_ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        usage_error_in_process(capsys, "serve", "--ckpt", tiny_ckpt, "--port", port, "--tp-world", 2, expect=f"cannot listen on 127.0.0.1:{port}")

"""The HTTP process's entry (`python -m pocketllm.serving.http_main FD`), started by the engine
process (http_process.py) with its end of the link as descriptor FD: the settings arrive first,
then it serves until the engine closes, fails or is gone. Its exit status: server.serve's."""

from __future__ import annotations

import socket
import sys


def main(argv: list[str]) -> int:
    from pocketllm.serving import wire

    link = socket.socket(fileno=int(argv[0]))
    receiver = wire.Receiver(link)
    first = receiver.one()
    if first is None or first[0] != wire.SETTINGS:
        return 1
    s = first[1]
    from pocketllm.inputs import load_tokenizer
    from pocketllm.serving.app import Served
    from pocketllm.serving.chat_template import load_chat_template
    from pocketllm.serving.engine_client import EngineClient
    from pocketllm.serving.metrics import Metrics
    from pocketllm.serving.protocol import Limits
    from pocketllm.serving.server import serve

    client = EngineClient(link, Metrics(), s["vocab"], s["max_len"], receiver)
    served = Served(
        limits=Limits(s["model"], s["max_len"], s["vocab"], dict(s["sampling_defaults"]), s["reasoning_parser"]),
        tokenizer=load_tokenizer(s["ckpt"]),
        chat_template=load_chat_template(s["ckpt"]),
        eos_ids=tuple(s["eos_ids"]),
        engine=client,
        api_key=s["api_key"],
        allowed_origins=tuple(s["allowed_origins"]),
    )
    return serve(served, s["host"], s["port"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

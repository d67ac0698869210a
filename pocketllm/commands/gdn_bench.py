"""`pocketllm gdn-bench`: its flags, turned into what pocketllm/bench/gdn_bench.py times."""

from __future__ import annotations

import argparse

from pocketllm.bench.gdn_bench import GdnBenchSpec, add_head_arguments, main
from pocketllm.commands.settings import device_plan
from pocketllm.device_kind import DEVICE_HELP
from pocketllm.model_args import DTYPES
from pocketllm.ops.gated_delta.chunked import DEFAULT_CHUNK_SIZE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="sequence length (default 4096)")
    add_head_arguments(parser)
    parser.add_argument("--dtype", default="float32", help="input dtype: " + ", ".join(DTYPES))
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--reps", type=int, default=5, help="timed reps per kernel (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: unchanged)")
    parser.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help=f"pocketllm chunk size (default {DEFAULT_CHUNK_SIZE})"
    )


def spec_of(args) -> GdnBenchSpec:
    return GdnBenchSpec(
        device_plan(args.device), args.tokens, args.key_heads, args.value_heads, args.head_dim, args.dtype, args.reps, args.threads, args.chunk_size
    )


def run(args) -> int:
    return main(spec_of(args))

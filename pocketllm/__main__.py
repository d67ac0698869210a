"""`python -m pocketllm` is the same entry point as the `pocketllm` console script."""

from pocketllm.cli import script

script()

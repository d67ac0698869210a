"""`python -m pocketllm` is the same entry point as the `pocketllm` console script."""

import sys

from pocketllm.cli import main

sys.exit(main())

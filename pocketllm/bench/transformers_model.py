"""transformers' Qwen3.5 modeling module for the commands and benchmarks that compare against it,
with or without fla's kernels in it.

transformers binds fla's kernels in place of its torch forms (the chunked and recurrent gated delta
rule, the gated RMSNorm) when it imports the model's module, wherever fla is importable: a GPU
machine with the cuda extra. Those Triton kernels take device tensors only, and up to 5.17 (the
lent GPU image's) transformers called them on CPU tensors too, failing there; later releases send
CPU tensors to the torch forms, each call first logging that it fell back. So a CPU run imports the
module with fla hidden, and gdn-bench, which times transformers' torch forms by name, always does.
"""

from __future__ import annotations

import importlib
import logging
import sys
from contextlib import contextmanager

MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"


def modeling(fla: bool):
    """The module, imported now with fla hidden unless `fla`; one imported before is returned as it
    is (a module is imported once per process, with whatever it bound then). Only that import is
    affected: fla stays importable for pocketllm in the same process."""
    if MODULE in sys.modules or fla:
        return importlib.import_module(MODULE)
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # import fla raises ImportError
    try:
        return importlib.import_module(MODULE)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


@contextmanager
def torch_forms_called_quietly():
    """transformers' line at a kernel's first call on its torch form ("falling back to its
    reference PyTorch implementation ... much slower", said once a process), left out where that
    form is what the caller asked for: around the first calls, not the timed ones."""
    log = logging.getLogger("transformers.integrations.hub_kernels")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)

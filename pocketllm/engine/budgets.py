"""The serving engine's default budgets: prompt rows a pass, the KV pool's share of free memory and
the prefix cache's share of that. Torch-free: `pocketllm serve`'s launcher checks its flags
against them before it starts a rank."""

# Prompt rows a pass may carry in all (serve --prefill-budget), beside one decode row per running
# sequence: the plan buffer every rank allocates holds that many rows. Chosen by measurement with
# vLLM's load generator (docs/serving.md, "Against vLLM").
DEFAULT_PREFILL_BUDGET = 1024
# Prompt rows one pass of `generate` carries at most: a longer prompt runs in passes of this many,
# its state carried between them, so its activations stay about a GiB at the 27B's widths (some
# 150 KB a row) where a 128k-token prompt in one pass held some 18 GB beside the weights. A
# multiple of the CPU's 256-row chunks, so a CPU's tokens are those of one pass.
LONGEST_PASS_ROWS = 8192
# The default KV pool budget: this fraction of the memory free once the weights are loaded (host
# memory on a CPU, shared by the ranks on the host; the device's own on CUDA/NPU), leaving the rest
# for activations, the per-sequence Gated DeltaNet state and whatever else runs there.
DEFAULT_KV_FRACTION = 0.5
# The prefix cache's copies of Gated DeltaNet state may take this fraction of the KV cache's budget
# (on top of the pool: the cached prefixes' KV blocks are the pool's own).
PREFIX_CACHE_FRACTION = 0.25
